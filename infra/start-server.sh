#!/usr/bin/env bash
# A long-lived Prefect server (UI + history) on SQLite; set PREFECT_API_DATABASE_CONNECTION_URL
# to a PostgreSQL URL for a team. Works offline: the UI is served from the installed package.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
exec "$root/.venv/bin/prefect" server start --host "${HSX_PREFECT_HOST:-127.0.0.1}" --port "${HSX_PREFECT_PORT:-4200}"
