#!/usr/bin/env bash
# Screenshots of a retried run's pages in the Prefect UI, taken with Debian's headless Chromium:
# a fresh stack (infra/prefect-up.sh) on a non-default port, a worker, an extraction whose chunk 1
# fails for real and is retried as the UI's Retry does (scripts/retried_run.py), then the flow
# run's page (both attempts' task runs, its tags and artifacts), its chunk table and summary.
#   bash scripts/screenshot-retried-run.sh [OUT_DIR] [PORT]     (needs: apt-get install chromium)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=${1:-$root/out/screenshots}; port=${2:-4517}
chromium=$(command -v chromium || true)
[ -n "$chromium" ] || { echo "screenshot: expected Debian's chromium (apt-get install chromium), found none" >&2; exit 2; }
mkdir -p "$out"
home=$(mktemp -d /tmp/hsx-screenshot-XXXXXX); chmod 755 "$home"
export HSX_PREFECT_HOME="$home" PREFECT_HOME="$home" PREFECT_API_URL="http://127.0.0.1:$port/api" \
  PREFECT_WORKER_QUERY_SECONDS=2
worker=""
cleanup() {
  if [ -n "$worker" ]; then kill -TERM -- "-$worker" 2>/dev/null || true; fi
  bash "$root/infra/prefect-down.sh" || true
  rm -rf "$home"
}
trap cleanup EXIT
bash "$root/infra/prefect-up.sh" --port "$port" >/dev/null
setsid bash "$root/infra/start-worker.sh" >"$home/worker.log" 2>&1 < /dev/null &
worker=$!
run_id=$("$root/.venv/bin/python" "$root/scripts/retried_run.py" "$home/retried.zarr")
echo "retried flow run: $run_id"
shoot() {  # NAME URL
  "$chromium" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$(mktemp -d "$home/chromium-XXXXXX")" --hide-scrollbars \
    --window-size=1600,1300 --virtual-time-budget=20000 --screenshot="$out/$1.png" "$2" \
    >"$home/chromium-$1.log" 2>&1
  echo "$out/$1.png"
}
ui="http://127.0.0.1:$port"
shoot run "$ui/runs/flow-run/$run_id"          # both attempts' task runs, tags, artifact marks
shoot chunk-table "$ui/artifacts/key/hsx-extract-chunks"   # the chunk table, per attempt
shoot run-summary "$ui/artifacts/key/hsx-run-summary"
