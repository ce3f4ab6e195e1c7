#!/bin/bash
# Tear down what .ci/slurm_multi_up.sh made: its jobs, the nodes (their PID namespaces end with their
# slurmd), slurmctld, slurmdbd, MariaDB, munged (each by its own PID file), the network namespaces and
# the bridge; then its job state, accounting database and shared directory (KEEP_STATE=1 keeps those:
# both or neither, job ids restart at 1 with an empty state directory). Leaves .ci/slurm_up.sh's
# single-node cluster alone. Every wait is bounded.
set -uo pipefail
ETC=/etc/slurm-pdm-multi
export SLURM_CONF=$ETC/slurm.conf
STATE=/var/lib/pdm-multi
RUN=/run/pdm-multi
SHARED=/srv/pdm-multi
BRIDGE=pdmbr0
alive() {  # $1 = pid: alive and not a zombie
  local s; s=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ "$s" != Z* ]]
}
stop() {  # $1 = pid file, $2 = signal (default TERM)
  [ -s "$1" ] || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1")
  alive "$pid" && kill -"${2:-TERM}" "$pid" 2>/dev/null
  for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
  alive "$pid" && kill -KILL "$pid" 2>/dev/null
  rm -f "$1"
}
if [ -s "$RUN/slurmctld.pid" ] && alive "$(cat "$RUN/slurmctld.pid")"; then
  jobs=$(timeout 20 squeue -h -o %A 2>/dev/null | sort -u)
  [ -n "$jobs" ] && timeout 20 scancel --quiet --full $jobs 2>/dev/null
fi
for f in "$RUN"/node-n*.pid; do
  [ -e "$f" ] || continue
  pid=$(cat "$f")
  child=$(awk '{print $1}' "/proc/$pid/task/$pid/children" 2>/dev/null)
  [ -n "$child" ] && kill -KILL "$child" 2>/dev/null  # slurmd is PID 1 of its node: the node ends with it
  stop "$f"
done
rm -f "$RUN"/slurmd-n*.pid  # each slurmd's own (PID 1 of its node); a killed one leaves it
stop "$RUN/slurmctld.pid"
stop "$RUN/slurmdbd.pid"
if [ "${KEEP_STATE:-0}" != 1 ]; then
  [ -S "$RUN/mysqld/mysqld.sock" ] && mysql --no-defaults -S "$RUN/mysqld/mysqld.sock" -u root \
    -e "DROP DATABASE IF EXISTS slurm_acct_db" 2>/dev/null
  rm -rf "$STATE/slurmctld" "$STATE/slurmd" "$SHARED"
fi
stop "$RUN/mysqld/mysqld.pid"
stop "$RUN/munge/munged.pid"
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^n[0-9]$'); do
  ip netns del "$ns"
done
for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^pdm-n[0-9]$'); do
  ip link del "$link" 2>/dev/null
done
ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
left=""
for f in "$RUN"/*.pid "$RUN"/*/*.pid; do [ -e "$f" ] && left="$left $f"; done
if [ -z "$left" ] && ! ip link show "$BRIDGE" >/dev/null 2>&1; then
  echo "slurm_multi_down: all stopped, namespaces and bridge gone"
else
  echo "slurm_multi_down: left:$left"
fi
