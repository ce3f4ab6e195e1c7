#!/bin/bash
# A 2-node SLURM (Debian 12's slurm-wlm 22.05) on this one machine, as root, without systemd: the test
# cluster of the `slurm-multi` profile. One slurmctld (with slurmdbd accounting) in the root network
# namespace; each compute node nI a real slurmd in its own network namespace (address 10.77.0.1I on the
# bridge pdmbr0, 10.77.0.1), with its own hostname, /tmp, /dev/shm and PID namespace (slurmd is PID 1
# of its node: SIGKILL to it ends everything on that node, as a crash does).
#
# Independent of .ci/slurm_up.sh's single-node cluster, which may run at the same time: its own
# configuration (/etc/slurm-pdm-multi; clients need SLURM_CONF=/etc/slurm-pdm-multi/slurm.conf), its own
# munged (own socket), MariaDB (port 3307), slurmdbd (6829), slurmctld (6827), state, logs and PID files.
# Only addresses inside the namespaces made here are used. Jobs' working files go to the shared
# directory /srv/pdm-multi (visible on every node; each node's /tmp is private).
#
# Idempotent: a running cluster is left alone, a node that is gone is started again (that is how a
# test brings back a killed node), a changed configuration restarts slurmctld and the nodes.
# Every wait is bounded. Stop everything with .ci/slurm_multi_down.sh.
#
#   NODES=N      compute nodes n1..nN (default 2, at most 9)
#   NODE_CPUS    CPUs each node advertises (default 4; SlurmdParameters=config_overrides)
#   PDM_MULTI_KEEP  more paths (colon-separated) every node must see at the same path although they lie
#                under /tmp or /dev/shm, which each node has private (the checkout this script lies in is
#                always kept: a clone under /tmp, its .venv and .venv-engine, are visible on every node)
set -euo pipefail
NODES=${NODES:-2}
NODE_CPUS=${NODE_CPUS:-4}
case "$NODES" in [1-9]) ;; *) echo "NODES must be 1..9, got $NODES" >&2; exit 2 ;; esac
export DEBIAN_FRONTEND=noninteractive
T0=$(date +%s.%N)
ts() { awk -v a="$T0" -v b="$(date +%s.%N)" -v m="$*" 'BEGIN{printf "[slurm_multi_up %5.1fs] %s\n", b-a, m}'; }

ETC=/etc/slurm-pdm-multi
export SLURM_CONF=$ETC/slurm.conf
STATE=/var/lib/pdm-multi
RUN=/run/pdm-multi
LOG=/var/log/slurm-pdm-multi
SHARED=/srv/pdm-multi
BRIDGE=pdmbr0
NET=10.77.0
CTLD_PORT=6827
DBD_PORT=6829
DB_PORT=3307
MUNGE_SOCKET=$RUN/munge/munge.socket.2
DB_SOCKET=$RUN/mysqld/mysqld.sock
HOST=$(hostname -s)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)

# ---------- packages (the same as .ci/slurm_up.sh's) ----------
PKGS="slurm-wlm munge slurmdbd mariadb-server iproute2 util-linux"
if ! dpkg -s $PKGS >/dev/null 2>&1; then
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $PKGS >/dev/null
  ts "packages installed"
fi

# ---------- helpers ----------
running() {  # $1 = pid file: is its process alive (zombies count as gone)?
  [ -s "$1" ] || return 1
  local s; s=$(ps -o stat= -p "$(cat "$1")" 2>/dev/null) || return 1
  [[ "$s" != Z* ]]
}
stop() {  # $1 = pid file
  running "$1" || { rm -f "$1"; return 0; }
  kill "$(cat "$1")" 2>/dev/null || true
  for _ in $(seq 100); do running "$1" || break; sleep 0.1; done
  rm -f "$1"
}
install_if_changed() {  # $1 = new file, $2 = target, $3 = mode; returns 0 when the target changed
  if [ -f "$2" ] && cmp -s "$1" "$2"; then rm -f "$1"; return 1; fi
  install -m "$3" "$1" "$2" && rm -f "$1"
}
wait_for() {  # $1 = seconds at most, then the command (itself bounded: `timeout 10 ...`)
  local end=$((SECONDS + $1)); shift
  while [ "$SECONDS" -lt "$end" ]; do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  "$@" >/dev/null 2>&1
}

# ---------- directories, munge key ----------
mkdir -p "$ETC" "$STATE/slurmctld" "$STATE/slurmd" "$RUN/munge" "$RUN/mysqld" "$LOG" "$SHARED"
chmod 1777 "$SHARED"
chown munge:munge "$RUN/munge" && chmod 755 "$RUN/munge"
chown mysql:mysql "$RUN/mysqld"
touch "$LOG/munged.log" && chown munge:munge "$LOG/munged.log"
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
fi

# ---------- network: a bridge in the root namespace, one namespace per node ----------
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link add "$BRIDGE" type bridge
fi
# (grep without -q: reading all of ip's output, so pipefail never sees a SIGPIPE and adds the address twice)
ip addr show dev "$BRIDGE" | grep "inet $NET.1/24" >/dev/null || ip addr add "$NET.1/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
{
  echo "127.0.0.1 localhost"
  echo "$NET.1 $HOST"
  for i in $(seq "$NODES"); do echo "$NET.1$i n$i"; done
} >"$RUN/hosts.new"
mv "$RUN/hosts.new" "$RUN/hosts"
for i in $(seq "$NODES"); do
  ns=n$i
  [ -e "/run/netns/$ns" ] || ip netns add "$ns"
  if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
    ip link del "pdm-$ns" 2>/dev/null || true
    ip link add "pdm-$ns" type veth peer name eth0 netns "$ns"
    ip link set "pdm-$ns" master "$BRIDGE" up
  fi
  ip -n "$ns" addr show dev eth0 | grep "inet $NET.1$i/24" >/dev/null || ip -n "$ns" addr add "$NET.1$i/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
done
ts "network: $BRIDGE $NET.1/24, namespaces $(ip netns list | awk '{print $1}' | grep -E '^n[0-9]$' | sort | tr '\n' ' ')"

# ---------- paths under a node's private /tmp or /dev/shm that every node must see anyway ----------
# A clone under /tmp calls <clone>/.venv/bin/python3 in its job scripts: without this, each node's empty
# private /tmp hides it (`slurm_script: …/.venv/bin/python3: No such file or directory`, runs LOST).
KEEP=""
IFS=: read -r -a extra <<<"${PDM_MULTI_KEEP:-}"
for p in "$REPO" "${extra[@]}"; do
  [ -n "$p" ] || continue
  [ -d "$p" ] || { echo "PDM_MULTI_KEEP: '$p' is not a directory" >&2; exit 2; }
  p=$(cd "$p" && pwd -P)
  case "$p" in
    *[[:space:]\'\"]*) echo "slurm_multi_up.sh: cannot keep '$p' on the nodes (blank or quote in the path)" >&2; exit 2 ;;
    /tmp/*|/dev/shm/*) case " $KEEP " in *" $p "*) ;; *) KEEP="$KEEP $p" ;; esac ;;
  esac
done
KEEP=${KEEP# }

# ---------- configuration ----------
NEW=$(mktemp)
{
  cat <<CONF
# written by pdmctl's .ci/slurm_multi_up.sh (NODES=$NODES)
ClusterName=pdmmulti
SlurmctldHost=${HOST}($NET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# its own munged; a requeued job waits cred_expire+1 s before it starts again (default 120)
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
# a dead node shows in about 30 s (default 300); a restarted one comes back by itself
SlurmdTimeout=20
ReturnToService=2
KillWait=5
# a job's processes may take more than SLURM's default 60 s to end on a machine this loaded (a job's
# process ending beside an engine's teardown of ~10 GB): past it, slurmd drains the node ("Kill task failed")
# and every later job of the one-node cluster waits
UnkillableStepTimeout=300
SlurmdParameters=config_overrides
MinJobAge=86400
# batch jobs are requeueable by default: a job that loses a node is requeued, not ended
JobRequeue=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# with auth/munge, the munged socket for connections to slurmdbd (without it they go to the default
# /run/munge socket: the single-node cluster's munged, which may be stopped at any time)
AccountingStoragePass=$MUNGE_SOCKET
CONF
  for i in $(seq "$NODES"); do
    echo "NodeName=n$i NodeAddr=$NET.1$i CPUs=$NODE_CPUS RealMemory=4000 State=UNKNOWN"
  done
  echo "PartitionName=multi Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP"
} >"$NEW"
CHANGED=0
install_if_changed "$NEW" "$ETC/slurm.conf" 644 && CHANGED=1
# the kept paths are mounted when a node starts: a new list restarts the nodes (slurmctld stays up)
NODES_CHANGED=0
printf '%s\n' "$KEEP" >"$RUN/keep.new"
install_if_changed "$RUN/keep.new" "$RUN/keep" 644 && NODES_CHANGED=1
NEW=$(mktemp)
cat >"$NEW" <<CONF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
CONF
DBD_CHANGED=0
install_if_changed "$NEW" "$ETC/slurmdbd.conf" 600 && DBD_CHANGED=1  # slurmdbd refuses a world-readable one

# ---------- munged, MariaDB, slurmdbd ----------
if ! running "$RUN/munge/munged.pid"; then
  runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCKET" --pid-file="$RUN/munge/munged.pid" \
    --seed-file="$RUN/munge/munge.seed" --log-file="$LOG/munged.log" --key-file=/etc/munge/munge.key
fi
wait_for 10 timeout 10 sh -c "munge -S '$MUNGE_SOCKET' -n | unmunge -S '$MUNGE_SOCKET'"
sql() { timeout 10 mysql --no-defaults -S "$DB_SOCKET" -u root "$@"; }
if [ ! -d "$STATE/mysql/mysql" ]; then
  rm -rf "$STATE/mysql"
  mariadb-install-db --no-defaults --user=mysql --datadir="$STATE/mysql" --skip-test-db \
    >>"$LOG/mariadb-install.log" 2>&1
  ts "mariadb data directory made"
fi
if ! running "$RUN/mysqld/mysqld.pid" || ! sql -e 'SELECT 1' >/dev/null 2>&1; then
  setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$STATE/mysql" --socket="$DB_SOCKET" \
    --port=$DB_PORT --bind-address=127.0.0.1 --pid-file="$RUN/mysqld/mysqld.pid" \
    --log-error="$LOG/mariadb.log" --skip-log-bin </dev/null >>"$LOG/mariadb.log" 2>&1 &
  wait_for 60 sql -e 'SELECT 1' || { echo "mariadb did not come up" >&2; tail -20 "$LOG/mariadb.log" >&2; exit 1; }
fi
sql -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
        FLUSH PRIVILEGES;"
[ "$DBD_CHANGED" = 1 ] && stop "$RUN/slurmdbd.pid"
running "$RUN/slurmdbd.pid" || slurmdbd
wait_for 60 timeout 10 sacctmgr -n list cluster \
  || { echo "slurmdbd did not come up" >&2; tail -20 "$LOG/slurmdbd.log" >&2; exit 1; }
ts "munged + mariadb (:$DB_PORT) + slurmdbd (:$DBD_PORT) up"

# ---------- slurmctld, then one slurmd per node namespace ----------
node_pid() {  # the node's slurmd (PID 1 of its PID namespace) as the root namespace sees it
  [ -s "$RUN/node-$1.pid" ] || return 1
  cat "/proc/$(cat "$RUN/node-$1.pid")/task/$(cat "$RUN/node-$1.pid")/children" 2>/dev/null | awk '{print $1}'
}
stop_node() {
  local pid; pid=$(node_pid "$1" || true)
  [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null
  for _ in $(seq 50); do running "$RUN/node-$1.pid" || break; sleep 0.1; done
  rm -f "$RUN/node-$1.pid"
}
if [ "$CHANGED" = 1 ]; then
  stop "$RUN/slurmctld.pid"
fi
if [ "$CHANGED" = 1 ] || [ "$NODES_CHANGED" = 1 ]; then
  for i in $(seq 9); do stop_node "n$i"; done
fi
running "$RUN/slurmctld.pid" || slurmctld
wait_for 30 timeout 10 scontrol ping || { echo "slurmctld did not answer" >&2; tail -20 "$LOG/slurmctld.log" >&2; exit 1; }
for i in $(seq "$NODES"); do
  ns=n$i
  running "$RUN/node-$ns.pid" && continue
  mkdir -p "$STATE/slurmd/$ns"
  # nsenter, not `ip netns exec` (that remounts /sys and hides /sys/fs/cgroup from slurmd); the new mount
  # namespace is private: the node's hostname, /etc/hosts, /tmp and /dev/shm stay its own, but for the
  # kept paths: bound aside before the private tmpfs covers them, moved back onto it after
  mkdir -p "$RUN/aside-$ns"
  setsid nsenter --net="/run/netns/$ns" unshare --uts --mount --pid --fork --mount-proc sh -c "
    set -e
    hostname $ns
    mount --bind '$RUN/hosts' /etc/hosts
    i=0; for p in $KEEP; do i=\$((i+1)); mkdir -p '$RUN/aside-$ns/'\$i; mount --bind \$p '$RUN/aside-$ns/'\$i; done
    mount -t tmpfs -o mode=1777,size=2g tmpfs /tmp
    mount -t tmpfs -o mode=1777,size=1g tmpfs /dev/shm
    i=0; for p in $KEEP; do i=\$((i+1)); mkdir -p \$p; mount --move '$RUN/aside-$ns/'\$i \$p; done
    # a daemon's cwd is /: one under the host's /tmp (a clone there) is gone on the node, and every job
    # step's slurmstepd said so on the job's stderr (\"Unable to return to working directory\")
    cd /
    exec slurmd -D -f '$SLURM_CONF' -N $ns" </dev/null >>"$LOG/node-$ns.out" 2>&1 &
  echo $! >"$RUN/node-$ns.pid"
done

node_states() { sinfo -h -N -o '%N %t' 2>/dev/null | sort -u; }
usable() { [ "$(node_states | awk '$2 ~ /^(idle|mix|alloc|comp)$/' | wc -l)" -ge "$NODES" ]; }
end=$((SECONDS + 60))
while [ "$SECONDS" -lt "$end" ]; do
  usable && break
  for n in $(node_states | awk '$2 ~ /^(drain|down|drng|fail)/ && $2 !~ /\*$/ {print $1}'); do
    scontrol update nodename="$n" state=resume 2>/dev/null || true
  done
  sleep 0.25
done
usable || { echo "nodes not usable: $(node_states | tr '\n' ' ')" >&2; tail -20 "$LOG"/slurmctld.log "$LOG"/slurmd-n*.log >&2; exit 1; }
ts "SLURM up (cluster pdmmulti, SLURM_CONF=$SLURM_CONF, shared $SHARED${KEEP:+, kept on the nodes: $KEEP}): $(node_states | tr '\n' ' ')"
