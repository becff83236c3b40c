#!/usr/bin/env bash
# A process worker for the hsx-gpu pool: runs flow runs on this node, one at a time.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
export HSX_REPO="$root" PREFECT_LOGGING_EXTRA_LOGGERS=hsx
"$root/.venv/bin/prefect" work-pool create hsx-gpu --type process --overwrite >/dev/null 2>&1 || true
exec "$root/.venv/bin/prefect" worker start --pool hsx-gpu --limit 1
