#!/bin/bash
# Stop the daemons .ci/slurm_up.sh started (by PID file). WIPE=1 also deletes the job state and the
# accounting database (both or neither: job ids restart at 1 with an empty state directory).
set -uo pipefail
stop() {  # $1 = pid file; zombies count as gone (PID 1 may reap them late)
  [ -s "$1" ] || return 0
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null || { rm -f "$1"; return 0; }
  for _ in $(seq 100); do
    s=$(ps -o stat= -p "$pid" 2>/dev/null) || break
    [[ "$s" == Z* ]] && break
    sleep 0.1
  done
  rm -f "$1"
}
if command -v squeue >/dev/null && [ -s /run/slurmctld.pid ]; then
  jobs=$(squeue -h -o %A 2>/dev/null | sort -u)
  [ -n "$jobs" ] && scancel --quiet --full $jobs 2>/dev/null
fi
stop /run/slurmd.pid
stop /run/slurmctld.pid
stop /run/slurmdbd.pid
if [ "${WIPE:-0}" = 1 ]; then
  mysql -e "DROP DATABASE IF EXISTS slurm_acct_db" 2>/dev/null || true
  rm -rf /var/spool/slurmctld/* /var/spool/slurmd/*
fi
stop /run/mysqld/mysqld.pid
stop /run/munge/munged.pid
left=$(ps -eo pid,stat,comm | awk '$3 ~ /^(slurmctld|slurmd|slurmdbd|munged|mariadbd)$/ && $2 !~ /^Z/')
if [ -z "$left" ]; then echo "slurm_down: all daemons stopped"; else echo "slurm_down: still running: $left"; fi
