#!/bin/bash
# An MLflow tracking server with a PostgreSQL backend store, on loopback only: the many-node store
# of the SLURM tests (jobs log over HTTP; nothing writes one SQLite file from many processes).
# Idempotent: starts what is not running, leaves what is. `.ci/mlflow_server_up.sh stop` stops both.
#
#   PG_PORT=5433            the dedicated PostgreSQL cluster `pdmctl` (Debian's postgresql package)
#   MLFLOW_PORT=5055        the server: http://127.0.0.1:$MLFLOW_PORT
#   MLFLOW_STATE=/var/lib/pdmctl-mlflow   artifacts, log and pid file
#   MLFLOW=mlflow           the mlflow command (default: on PATH, else ./.venv/bin/mlflow); its Python
#                           needs psycopg2 (pip install psycopg2-binary; in pdmctl's [dev] and [cluster] extras)
set -euo pipefail
PG_PORT=${PG_PORT:-5433}
MLFLOW_PORT=${MLFLOW_PORT:-5055}
STATE=${MLFLOW_STATE:-/var/lib/pdmctl-mlflow}
HOST=127.0.0.1  # loopback only; on a cluster, bind an address the compute nodes reach (docs/CLUSTER.md)
HERE=$(cd "$(dirname "$0")/.." && pwd)
MLFLOW=${MLFLOW:-$(command -v mlflow || echo "$HERE/.venv/bin/mlflow")}
PG_URI="postgresql+psycopg2://mlflow:mlflow@$HOST:$PG_PORT/mlflow"
PIDFILE=$STATE/server.pid
export DEBIAN_FRONTEND=noninteractive
T0=$(date +%s.%N)
ts() { awk -v a="$T0" -v b="$(date +%s.%N)" -v m="$*" 'BEGIN{printf "[mlflow_server_up %5.1fs] %s\n", b-a, m}'; }

alive() { [ -s "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }
healthy() { python3 - "$1" <<'PY' 2>/dev/null
import sys, urllib.request
sys.exit(0 if urllib.request.urlopen(sys.argv[1] + "/health", timeout=10).status == 200 else 1)
PY
}

if [ "${1:-}" = stop ]; then
  if alive; then
    # MLflow's server keeps its job queue in a directory of its own under /dev/shm and never removes it
    HUEY=$(for p in $(pgrep -g "$(cat "$PIDFILE")"); do tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null; done |
           sed -n 's|^_MLFLOW_HUEY_STORAGE_PATH=\(/dev/shm/tmp[^/]*\)$|\1|p' | sort -u)
    kill -- -"$(cat "$PIDFILE")" 2>/dev/null || kill "$(cat "$PIDFILE")" 2>/dev/null || true
    for _ in $(seq 50); do alive || break; sleep 0.1; done
  fi
  rm -f "$PIDFILE"
  [ -z "${HUEY:-}" ] || rm -rf $HUEY
  pg_ctlcluster 15 pdmctl stop 2>/dev/null || true
  echo "mlflow server and PostgreSQL cluster pdmctl stopped"
  exit 0
fi

# ---------- PostgreSQL ----------
if ! command -v pg_createcluster >/dev/null; then
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends postgresql >/dev/null
  ts "postgresql installed"
fi
PG_VERSION=$(ls /usr/lib/postgresql | sort -n | tail -1)
if ! pg_lsclusters -h | awk '{print $2}' | grep -qx pdmctl; then
  pg_createcluster "$PG_VERSION" pdmctl -p "$PG_PORT" -- --auth-local=peer --auth-host=scram-sha-256 >/dev/null
fi
# Debian's postgresql.conf reads conf.d/ last
printf "listen_addresses = '%s'\nport = %s\nmax_connections = 200\n" "$HOST" "$PG_PORT" \
  >"/etc/postgresql/$PG_VERSION/pdmctl/conf.d/pdmctl.conf"
if ! pg_lsclusters -h | awk '$2 == "pdmctl" {print $4}' | grep -qx online; then
  mkdir -p /run/postgresql && chown postgres:postgres /run/postgresql
  pg_ctlcluster "$PG_VERSION" pdmctl start
fi
psql_admin() { runuser -u postgres -- psql -p "$PG_PORT" -qtA "$@"; }
[ "$(psql_admin -c "SELECT 1 FROM pg_roles WHERE rolname='mlflow'")" = 1 ] ||
  psql_admin -c "CREATE ROLE mlflow LOGIN PASSWORD 'mlflow'"
[ "$(psql_admin -c "SELECT 1 FROM pg_database WHERE datname='mlflow'")" = 1 ] ||
  psql_admin -c "CREATE DATABASE mlflow OWNER mlflow"
ts "PostgreSQL $PG_VERSION/pdmctl on $HOST:$PG_PORT, database mlflow"

# ---------- mlflow server ----------
URL="http://$HOST:$MLFLOW_PORT"
# One caller at a time (the suite's lanes and the engine's tests call this concurrently): a second caller
# waits for the first one's server instead of starting its own beside it. The server itself does not
# inherit the lock (9>&- below), or every later caller would wait on it for good.
mkdir -p "$STATE"
exec 9>"$STATE/start.lock"
flock 9
# A server that runs but does not answer yet (starting, or slow on a loaded machine) is waited for, never
# killed: the tests beside this caller use it.
if ! healthy "$URL" && alive; then
  for _ in $(seq 120); do healthy "$URL" && break; alive || break; sleep 1; done
fi
if ! healthy "$URL"; then
  alive && { kill -- -"$(cat "$PIDFILE")" 2>/dev/null || kill "$(cat "$PIDFILE")" 2>/dev/null || true; }
  mkdir -p "$STATE/artifacts"
  # setsid: its own process group, so `stop` ends the workers with it
  setsid "$MLFLOW" server --backend-store-uri "$PG_URI" --artifacts-destination "$STATE/artifacts" \
    --host "$HOST" --port "$MLFLOW_PORT" --workers 4 >>"$STATE/server.log" 2>&1 </dev/null 9>&- &
  echo $! >"$PIDFILE"
  for _ in $(seq 240); do healthy "$URL" && break; alive || break; sleep 0.5; done
  healthy "$URL" || { echo "mlflow server did not come up" >&2; tail -30 "$STATE/server.log" >&2; exit 1; }
  # Each worker opens its store at its first API call (1-2 s here idle, over 5 s on the loaded CI, past
  # pdmctl's 5 s): calls side by side until every worker has answered one quickly, before anyone is told
  # the server is up.
  python3 - "$URL" <<'PY'
import concurrent.futures, sys, time, urllib.error, urllib.request
api = sys.argv[1] + "/api/2.0/mlflow/"
urls = [api + "experiments/search?max_results=1", api + "experiments/get-by-name?experiment_name=-warm-up-",
        api + "runs/search"]
def call(i):
    started = time.monotonic()
    try:
        urllib.request.urlopen(urls[i % len(urls)], timeout=300, data=b"{}" if i % 3 == 2 else None).read()
    except urllib.error.HTTPError:  # the experiment does not exist: an answer all the same
        pass
    return time.monotonic() - started
with concurrent.futures.ThreadPoolExecutor(16) as pool:
    for _ in range(8):
        if max(pool.map(call, range(24))) < 0.5:
            break
PY
fi
ts "mlflow server at $URL (backend $PG_URI, artifacts $STATE/artifacts)"
