#!/usr/bin/env bash
# Stop what infra/prefect-up.sh started (the server on each port it used, and its PostgreSQL).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
home=${HSX_PREFECT_HOME:-$root/.prefect-server}
for pidfile in "$home"/server-*.pid; do
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true  # its own session
  rm -f "$pidfile"
done
if [ -f "$home/postgres/PG_VERSION" ]; then
  bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$bin/pg_ctl" -D "$home/postgres" -m fast stop >/dev/null 2>&1 || true
  else "$bin/pg_ctl" -D "$home/postgres" -m fast stop >/dev/null 2>&1 || true; fi
fi
