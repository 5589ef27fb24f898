#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on 127.0.0.1; start them when they do not.
# Used by `make test` and .ci/run. Idempotent.
set -euo pipefail

answers() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

if ! answers 5432; then
  echo "PostgreSQL is not answering on 127.0.0.1:5432; starting it"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
fi
if ! answers 6379; then
  echo "Redis is not answering on 127.0.0.1:6379; starting it"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
fi
for _ in $(seq 1 30); do
  answers 5432 && answers 6379 && exit 0
  sleep 1
done
echo "PostgreSQL or Redis still not answering on 127.0.0.1 after 30 s" >&2
exit 1
