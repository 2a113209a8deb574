#!/usr/bin/env bash
# The cluster's PostgreSQL (image target `postgres`): on the first start, a cluster with the user
# `elastic` (password $POSTGRES_PASSWORD) and the databases `airflow` (Airflow's metadata) and
# `elastic_pool` (the pool ledger); then the server, on $POSTGRES_PORT at $POSTGRES_HOST.
set -euo pipefail
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD (docker/cluster.env)}"
PORT=${POSTGRES_PORT:-5432}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s' "$POSTGRES_PASSWORD" >"$pwfile"
  initdb -D "$PGDATA" -U elastic --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
    -E UTF8 >/dev/null
  rm -f "$pwfile"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -p $PORT -k /tmp" -w start >/dev/null
  for db in airflow elastic_pool; do
    psql -q -h /tmp -p "$PORT" -U elastic -d postgres -c "CREATE DATABASE $db"
  done
  pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  echo "postgres.sh: databases airflow and elastic_pool created"
fi
exec postgres -D "$PGDATA" -c listen_addresses="${POSTGRES_HOST:-127.0.0.1}" -p "$PORT" -k /tmp
