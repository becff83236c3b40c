#!/usr/bin/env bash
# A PostgreSQL for the Prefect server, from Debian's package (postgresql-15), its data in a folder
# of ours, listening on 127.0.0.1 only. Prints the database URL for PREFECT_API_DATABASE_CONNECTION_URL.
#   infra/start-postgres.sh DATA_DIR [PORT]      (stop: pg_ctl -D DATA_DIR stop, or infra/prefect-down.sh)
set -euo pipefail
data=${1:?usage: infra/start-postgres.sh DATA_DIR [PORT]}
port=${2:-5433}
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
  echo "start-postgres: expected Debian's PostgreSQL (/usr/lib/postgresql/*/bin/initdb), found none;" \
    "install it with: apt-get install -y postgresql" >&2
  exit 2
fi
# PostgreSQL refuses to run as root: as root, its commands run as the package's postgres user.
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
mkdir -p "$data"
data=$(cd "$data" && pwd)
if [ "$(id -u)" = 0 ]; then chown postgres "$data"; fi
if [ ! -f "$data/PG_VERSION" ]; then
  as_pg "$bin/initdb" -D "$data" -U prefect --auth=trust -E UTF8 >"$data.initdb.log" 2>&1 \
    || { cat "$data.initdb.log" >&2; exit 1; }
fi
if ! as_pg "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
  as_pg "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $data" start >/dev/null \
    || { tail -20 "$data/server.log" >&2; exit 1; }
fi
exists=$(as_pg "$bin/psql" -h 127.0.0.1 -p "$port" -U prefect -d postgres -tAc \
  "SELECT 1 FROM pg_database WHERE datname = 'prefect'")
if [ "$exists" != 1 ]; then
  as_pg "$bin/createdb" -h 127.0.0.1 -p "$port" -U prefect prefect
fi
echo "postgresql+asyncpg://prefect@127.0.0.1:$port/prefect"
