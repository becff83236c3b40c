#!/usr/bin/env bash
# Everything the Prefect UI needs for hsx, from nothing, in an order that works:
#   1. the server on 127.0.0.1:PORT, its UI told that port (PREFECT_UI_API_URL), its database
#      (SQLite in the Prefect home by default; --postgres: Debian's PostgreSQL via start-postgres.sh);
#   2. the process work pools hsx-gpu (GPU nodes) and hsx-cpu (parents over many nodes);
#   3. the deployments of infra/prefect.yaml (extract, preflight, verify with a nightly schedule);
#   4. the tiny bundled models, so the deployments' defaults run as they are;
#   5. a check that the scheduler creates runs and logs no error (other ERROR lines: reported).
# Then start a worker on each GPU node: PREFECT_API_URL=... infra/start-worker.sh
#
#   infra/prefect-up.sh [--port 4200] [--postgres [--pg-port 5433]] [--host 127.0.0.1]
# State (database, logs, results) lives in $HSX_PREFECT_HOME (default: .prefect-server/ here).
# Stop it with infra/prefect-down.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
port=4200; host=127.0.0.1; db=sqlite; pg_port=5433
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port=$2; shift 2 ;;
    --host) host=$2; shift 2 ;;  # loopback unless told otherwise
    --postgres) db=postgres; shift ;;
    --pg-port) pg_port=$2; shift 2 ;;
    *) echo "prefect-up: unknown option $1 (expected --port, --host, --postgres, --pg-port)" >&2; exit 2 ;;
  esac
done
bash "$root/scripts/bootstrap.sh"
home=${HSX_PREFECT_HOME:-$root/.prefect-server}
mkdir -p "$home"
export PREFECT_HOME="$home" PREFECT_LOCAL_STORAGE_PATH="$home/storage"
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_SERVER_API_HOST="$host" PREFECT_SERVER_API_PORT="$port"
# The UI asks the API at this URL: without the port, every page but 4200's says "Oops".
export PREFECT_UI_API_URL="http://$host:$port/api" PREFECT_API_URL="http://$host:$port/api"
if [ "$db" = postgres ]; then
  PREFECT_API_DATABASE_CONNECTION_URL=$(bash "$root/infra/start-postgres.sh" "$home/postgres" "$pg_port")
else
  PREFECT_API_DATABASE_CONNECTION_URL="sqlite+aiosqlite:///$home/prefect.db"
  # A worker's polling and the flows' writes share one SQLite file: wait for its lock.
  export PREFECT_API_DATABASE_TIMEOUT=${PREFECT_API_DATABASE_TIMEOUT:-60}
fi
export PREFECT_API_DATABASE_CONNECTION_URL
# The deployments' concurrency leases (concurrency_limit: one engine per node) on disk, not in
# the server's memory: after a restart a running flow renews its lease (with the default
# in-memory storage the lease is gone, the renewal fails and Prefect crashes the run to keep the
# limit). Several servers behind one database need a shared one instead (prefect-redis).
export PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=${PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE:-prefect.server.concurrency.lease_storage.filesystem}
if curl -sf "http://$host:$port/api/health" >/dev/null 2>&1; then
  echo "prefect-up: a server already answers on $host:$port" >&2; exit 1
fi
log="$home/server-$port.log"
# hsx's modules (flows/server_launch.py, flows/stack_check.py) from this checkout, wherever
# this script is started from.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# Prefect's server, its SQLite transactions begun IMMEDIATE (flows/server_launch.py: without it
# the worker's polls log "database is locked" tracebacks all day).
setsid "$root/.venv/bin/python" -m flows.server_launch server start --host "$host" --port "$port" \
  >"$log" 2>&1 < /dev/null &
echo $! > "$home/server-$port.pid"
for _ in $(seq 1 120); do
  curl -sf "http://$host:$port/api/health" >/dev/null 2>&1 && break
  if ! kill -0 "$(cat "$home/server-$port.pid")" 2>/dev/null; then
    echo "prefect-up: the server exited; its log ($log):" >&2; tail -30 "$log" >&2; exit 1
  fi
  sleep 0.5
done
curl -sf "http://$host:$port/api/health" >/dev/null || { echo "prefect-up: no answer on $host:$port after 60 s ($log)" >&2; exit 1; }
prefect="$root/.venv/bin/prefect"
# hsx-gpu: one worker per GPU node, beside its `hsx serve`; hsx-cpu: the parents of runs over
# many nodes (planning, store creation, watching the items), on any machine.
for pool in hsx-gpu hsx-cpu; do
  if ! "$prefect" work-pool inspect "$pool" >/dev/null 2>&1; then
    "$prefect" work-pool create "$pool" --type process >/dev/null
  fi
done
# Zombie detection: runs whose heartbeats stop are marked Crashed (infra/automations/).
window="${HSX_ZOMBIE_WINDOW_S:-90}"
sed "s/WINDOW_S/$window/g" "$root/infra/automations/crash-silent-flow-runs.yaml" >"$home/automations.yaml"
if ! "$prefect" automation inspect hsx-crash-silent-flow-runs >/dev/null 2>&1; then
  "$prefect" automation create --from-file "$home/automations.yaml" >"$home/automations.log" 2>&1 \
    || { echo "prefect-up: automation not created ($home/automations.log):" >&2; tail -20 "$home/automations.log" >&2; exit 1; }
fi
"$root/.venv/bin/hsx" make-tiny-models "$root/models" >/dev/null
(cd "$root" && HSX_REPO="$root" "$prefect" --no-prompt deploy --prefect-file infra/prefect.yaml --all >"$home/deploy.log" 2>&1) \
  || { echo "prefect-up: deploy failed ($home/deploy.log):" >&2; tail -30 "$home/deploy.log" >&2; exit 1; }
# The scheduler creates runs (a probe deployment's, then removed) and logs no error: Prefect
# 3.7.7's scheduler failed every minute on SQLAlchemy 2.1 while all else worked.
"$root/.venv/bin/python" -m flows.stack_check --server-log "$log" \
  || { echo "prefect-up: the server is up but does not run cleanly (above; its log: $log)" >&2; exit 1; }
cat <<DONE
Prefect server: http://$host:$port  (database: $db; state in $home)
  export PREFECT_API_URL=http://$host:$port/api
  infra/start-worker.sh          # a worker for pool hsx-gpu, on each GPU node
  HSX_WORKER_POOL=hsx-cpu infra/start-worker.sh   # parents of runs over many nodes
  hsx runs                       # past runs; the UI shows the same
DONE
