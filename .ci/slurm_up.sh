#!/bin/bash
# A single-node SLURM (Debian 12's slurm-wlm 22.05) on localhost, as root, without systemd:
# the test cluster of the `slurm-local` profile. Idempotent: it converges a running cluster to the
# configuration asked for, restarting only the daemons whose configuration changed.
#
#   ACCOUNTING=dbd   slurmdbd + MariaDB: real `sacct` (default; submitit and pdmctl need it)
#   ACCOUNTING=none  AccountingStorageType=none: `sacct` refuses, pdmctl falls back to `squeue`
#   FAKE_GPUS=N      the node advertises N GPUs (gres/gpu on /dev/null clones; jobs must not call CUDA)
#   REAL_GPUS=1      the node's gres/gpu are this machine's /dev/nvidia0..N-1 instead (scripts/gpu-check.sh)
#   MAX_ARRAY_SIZE   the cluster's MaxArraySize (default 1001, SLURM's own default)
#
# Switching ACCOUNTING restarts slurmctld and slurmd only; running jobs survive (their state is in
# /var/spool/slurmctld, their processes belong to slurmstepd). Stop everything with .ci/slurm_down.sh.
set -euo pipefail
ACCOUNTING=${ACCOUNTING:-dbd}
FAKE_GPUS=${FAKE_GPUS:-8}
GPU_FILES=/var/lib/slurm-fakegpu/nvidia
if [ "${REAL_GPUS:-0}" = 1 ]; then  # the GPUs jobs get are real ones: CUDA_VISIBLE_DEVICES from SLURM's gres
  FAKE_GPUS=$(find /dev -maxdepth 1 -regex '/dev/nvidia[0-9]+' | wc -l)
  [ "$FAKE_GPUS" -ge 1 ] || { echo "slurm_up: REAL_GPUS=1 but this machine has no /dev/nvidia0" >&2; exit 2; }
  GPU_FILES=/dev/nvidia
fi
MAX_ARRAY_SIZE=${MAX_ARRAY_SIZE:-1001}
case "$ACCOUNTING" in dbd | none) ;; *) echo "ACCOUNTING must be dbd or none, got $ACCOUNTING" >&2; exit 2 ;; esac
export DEBIAN_FRONTEND=noninteractive
T0=$(date +%s.%N)
ts() { awk -v a="$T0" -v b="$(date +%s.%N)" -v m="$*" 'BEGIN{printf "[slurm_up %5.1fs] %s\n", b-a, m}'; }

# ---------- packages ----------
PKGS="slurm-wlm munge"
[ "$ACCOUNTING" = dbd ] && PKGS="$PKGS slurmdbd mariadb-server"
if ! dpkg -s $PKGS >/dev/null 2>&1; then
  # no systemd here: keep the packages' postinst scripts from starting services
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $PKGS >/dev/null
  ts "packages installed"
fi

# ---------- host, directories, munge key, fake GPUs ----------
HOST=$(hostname -s)
getent hosts "$HOST" >/dev/null || echo "127.0.0.1 $HOST" >>/etc/hosts
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/slurm-fakegpu
chown munge:munge /run/munge && chmod 755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
fi
for i in $(seq 0 $((FAKE_GPUS - 1))); do  # gres/gpu needs File= naming character devices
  [ -c $GPU_FILES$i ] && continue
  [ "${REAL_GPUS:-0}" = 1 ] && { echo "slurm_up: REAL_GPUS=1 but $GPU_FILES$i is missing" >&2; exit 2; }
  mknod -m 666 $GPU_FILES$i c 1 3
done

# ---------- helpers ----------
running() {  # $1 = pid file: is its process alive (zombies count as gone)?
  [ -s "$1" ] || return 1
  local s; s=$(ps -o stat= -p "$(cat "$1")" 2>/dev/null) || return 1
  [[ "$s" != Z* ]]
}
stop() {  # $1 = pid file
  running "$1" || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do running "$1" || break; sleep 0.1; done
  rm -f "$1"
}
install_if_changed() {  # $1 = new file, $2 = target, $3 = mode; returns 0 when the target changed
  if [ -f "$2" ] && cmp -s "$1" "$2"; then rm -f "$1"; return 1; fi
  install -m "$3" "$1" "$2" && rm -f "$1"
}

# ---------- configuration ----------
if [ "$ACCOUNTING" = dbd ]; then
  ACCT=$'AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost'
else
  ACCT="AccountingStorageType=accounting_storage/none"
fi
NEW=$(mktemp)
cat >"$NEW" <<CONF
# written by pdmctl's .ci/slurm_up.sh (ACCOUNTING=$ACCOUNTING)
ClusterName=localcluster
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire+1 s before it starts again (default 120)
AuthInfo=cred_expire=10
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# cgroup plugins cannot constrain devices in this sandbox
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
# CR_Core (not CR_Core_Memory): with memory as a consumable and no DefMemPerCPU jobs run one at a time
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
# SIGTERM -> SIGKILL grace: pdmctl's SLURM jobs leave SIGTERM to the scheduler
KillWait=5
# a job's processes may take more than SLURM's default 60 s to end on a machine this loaded (a job's
# process ending beside an engine's teardown of ~10 GB): past it, slurmd drains the node ("Kill task failed")
# and every later job of the one-node cluster waits
UnkillableStepTimeout=300
# the node may advertise more than the hardware has (a fake 8-GPU node on 2 cores)
SlurmdParameters=config_overrides
MinJobAge=86400
MaxArraySize=${MAX_ARRAY_SIZE}
JobRequeue=1
JobAcctGatherType=jobacct_gather/none
${ACCT}
GresTypes=gpu
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${FAKE_CPUS:-64} RealMemory=${FAKE_MEM_MB:-1000000} Gres=gpu:${FAKE_GPUS} State=UNKNOWN
PartitionName=debug Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP
CONF
CHANGED=0
install_if_changed "$NEW" /etc/slurm/slurm.conf 644 && CHANGED=1
NEW=$(mktemp)
printf 'AutoDetect=off\nNodeName=%s Name=gpu File=%s[0-%d]\n' "$HOST" "$GPU_FILES" $((FAKE_GPUS - 1)) >"$NEW"
install_if_changed "$NEW" /etc/slurm/gres.conf 644 && CHANGED=1

# ---------- daemons ----------
munge -n >/dev/null 2>&1 || runuser -u munge -- /usr/sbin/munged
munge -n | unmunge >/dev/null

if [ "$ACCOUNTING" = dbd ]; then
  mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
  if ! mysqladmin ping >/dev/null 2>&1; then
    setsid /usr/sbin/mariadbd --user=mysql --pid-file=/run/mysqld/mysqld.pid --bind-address=127.0.0.1 \
      >>/var/log/slurm/mariadb.log 2>&1 </dev/null &
    for _ in $(seq 120); do mysqladmin ping >/dev/null 2>&1 && break; sleep 0.25; done
  fi
  mysql -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
  NEW=$(mktemp)
  cat >"$NEW" <<CONF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
PidFile=/run/slurmdbd.pid
LogFile=/var/log/slurm/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
CONF
  # slurmdbd refuses a world-readable configuration
  install_if_changed "$NEW" /etc/slurm/slurmdbd.conf 600 && stop /run/slurmdbd.pid
  running /run/slurmdbd.pid || slurmdbd
  for _ in $(seq 120); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.25; done
  sacctmgr -n list cluster >/dev/null 2>&1 || { echo "slurmdbd did not come up" >&2; tail -20 /var/log/slurm/slurmdbd.log >&2; exit 1; }
  ts "mariadb + slurmdbd up"
fi

if [ "$CHANGED" = 1 ]; then  # AccountingStorageType and friends need a restart, not a reconfigure
  stop /run/slurmctld.pid
  stop /run/slurmd.pid
fi
running /run/slurmctld.pid || slurmctld
running /run/slurmd.pid || slurmd

node_state() { sinfo -h -N -n "$HOST" -o '%t' 2>/dev/null | head -1; }
for _ in $(seq 160); do
  case "$(node_state)" in
    idle | mix | alloc | comp) break ;;
    drain* | down* | drng*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
  esac
  sleep 0.25
done
case "$(node_state)" in
  idle | mix | alloc | comp) ;;
  *) echo "node $HOST is '$(node_state)', not usable" >&2; tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2; exit 1 ;;
esac
ts "SLURM up (accounting: $ACCOUNTING, node $HOST: $(node_state), $(sinfo -h -o '%G' | head -1))"
