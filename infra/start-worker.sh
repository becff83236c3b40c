#!/usr/bin/env bash
# A process worker for the hsx-gpu pool (HSX_WORKER_POOL=hsx-cpu: the parents of runs over many
# nodes): runs flow runs on this node, HSX_WORKER_LIMIT at a time (default 1: one engine per
# node). Needs PREFECT_API_URL of the server. On a GPU node of a run over many nodes, set
# HSX_ENGINE__URL to this node's `hsx serve` servers: the item runs it starts use them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${PREFECT_API_URL:?expected PREFECT_API_URL of the Prefect server (infra/prefect-up.sh prints it)}"
bash "$root/scripts/bootstrap.sh"
export HSX_REPO="$root" PREFECT_LOGGING_EXTRA_LOGGERS=hsx
# The worker's Prefect state (and anything Prefect keeps of a failed run: results stay off, the
# store is the result) lives in hsx's Prefect home, the server's where both run on one node;
# never ~/.prefect.
export PREFECT_HOME="${PREFECT_HOME:-${HSX_PREFECT_HOME:-$root/.prefect-server}}"
export PREFECT_LOCAL_STORAGE_PATH="$PREFECT_HOME/storage"
mkdir -p "$PREFECT_LOCAL_STORAGE_PATH"
prefect="$root/.venv/bin/prefect"
pool="${HSX_WORKER_POOL:-hsx-gpu}"
if ! "$prefect" work-pool inspect "$pool" >/dev/null 2>&1; then
  "$prefect" work-pool create "$pool" --type process >/dev/null
fi
# Supervised, as systemd's Restart=always would: a worker that exits is started again (and says
# so in its log; the Prefect-stack tests fail on that line). flows/worker_launch.py runs Prefect's
# worker with a fix for Prefect 3.7's exit on a Retry pressed while the last attempt's process
# is still exiting, and its own stop: one SIGTERM (systemctl stop, docker stop, prefect-down) or
# Ctrl-C takes no new run, sends each running flow run SIGTERM and waits up to
# HSX_WORKER_STOP_GRACE_S (60 s) for them to end Cancelled with their records, then stops.
child=""
# (`|| true`: under set -e a worker that ended by a signal would end the trap before its exit 0)
trap 'if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null; wait "$child" || true; fi; exit 0' TERM INT
cd "$root"
while true; do
  "$root/.venv/bin/python" -m flows.worker_launch worker start --pool "$pool" \
    --limit "${HSX_WORKER_LIMIT:-1}" &
  child=$!
  code=0; wait "$child" || code=$?
  echo "start-worker: the worker exited with status $code; restarting it in 5 s" >&2
  sleep 5
done
