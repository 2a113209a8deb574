#!/usr/bin/env bash
# The elastic-ops image's entry point: wait for what the command needs, then run it.
#   WAIT_FOR="127.0.0.1:15432 127.0.0.1:16379"   TCP addresses that must accept connections first
#   WAIT_FOR_MIGRATIONS=1                         Airflow's metadata database must be migrated first
# (Docker Compose orders the services by their health checks too; Podman before 4.6 cannot, so the
# services wait for themselves.)
set -euo pipefail
for addr in ${WAIT_FOR:-}; do
  host=${addr%:*} port=${addr##*:}
  for i in $(seq 300); do
    (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null && break
    [ "$i" = 300 ] && { echo "entrypoint: nothing answers at $addr after 300 s" >&2; exit 1; }
    sleep 1
  done
done
if [ "${WAIT_FOR_MIGRATIONS:-0}" = 1 ]; then
  airflow db check-migrations --migration-wait-timeout 600 >/dev/null
fi
exec "$@"
