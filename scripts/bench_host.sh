#!/usr/bin/env bash
# Run bench/site_ingest.py on a bare host (no network, no PostgreSQL or Redis installed, Python 3.12 with some of
# the site's packages): unpack a carried bundle, start PostgreSQL and Redis from it, run the bench (which starts
# `manage.py serve`) with both, then stop them. The bundle (BUNDLE, default .devbundle) holds:
#   site.tar.xz  the site's Python packages for that Python, unpacked onto PYTHONPATH ahead of the host's own;
#   srv.tar.xz   PostgreSQL's and Redis's files as their Debian packages lay them out (usr/lib/postgresql/..,
#                usr/share/postgresql/.., bin/redis-server) and, under lib/, the shared libraries they need
#                that the host lacks (LD_LIBRARY_PATH for those two servers only); zoneinfo/ for a host without it.
# How the bundle of 2026-12-04 was made (docs/operators.md, "On a 16-core host"; 58 MB, under the device's 64 MiB):
#   site: `pip download --only-binary=:all: --python-version 3.12 --implementation cp --platform
#         manylinux_2_28_x86_64 (and _2_27, _2_24, _2_17, 2014, 1) -r` requirements/base.txt, less the packages the
#         host has (pyarrow, numpy, httpx and its deps, rich, typer, click, prometheus-client, pyyaml, requests...)
#         and duckdb (the site does not import it); `python3.12 -m pip install --no-deps --target site *.whl`;
#         `strip --strip-unneeded` on its .so files (polars, zstandard: 330 -> 234 MB); `tar -cJ` (40 MB).
#   srv:  on Debian 12 with postgresql-15 and redis-server installed: postgres, initdb, pg_ctl; plpgsql.so,
#         dict_snowball.so and the encoding conversions of /usr/lib/postgresql/15/lib; /usr/share/postgresql/15
#         (of extension/, plpgsql only); /usr/bin/redis-server; lib/ = what `ldd` lists for those, less glibc and
#         the libraries a Ubuntu 24.04 host with Python has (libstdc++, libgcc_s, libz, liblzma, libzstd, liblz4,
#         libssl, libcrypto, libffi, libsystemd, libgcrypt, libgpg-error, libcap, libpam, libaudit, libcap-ng);
#         zoneinfo/ = UTC, GMT, Etc/UTC, Etc/GMT; everything stripped; `tar -cJ` (18 MB).
# Rebuilt the same way on 2026-12-04 17:00 UTC (`pip download ... -r requirements/base.txt` with its dependencies,
# less the host's; Django's locales other than en and Twisted's and Autobahn's tests left out; site 38 MB with xz -9,
# srv 17 MB), kept in .device-carry/ (ignored by git) and run with BUNDLE=.device-carry.
# Rebuilt again on 2026-12-04 20:07 UTC the same way, with uvicorn, httptools, uvloop and websockets (site 41 MB,
# srv 17 MB). The device runs a copy of the session's main checkout: a branch's tree went as `git archive | xz` in
# the bundle folder, unpacked on the device and run from there with --baseline-tree pointing at the main checkout.
# Its arguments are passed to the bench (BENCH, default bench/site_ingest.py). Figures and logs go to OUT
# (default ./bench-out). PostgreSQL refuses to run as root: it runs as PG_USER (created when missing).
set -euo pipefail
BUNDLE=${BUNDLE:-.devbundle}
OUT=${OUT:-$PWD/bench-out}
WORK=${WORK:-/tmp/comminsight-bench}
PG_PORT=${PG_PORT:-5432}
REDIS_PORT=${REDIS_PORT:-6379}
PG_USER=${PG_USER:-pgbench}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"

if [ ! -d "$WORK/site" ]; then
    mkdir -p "$WORK/site.new" && tar -xJf "$BUNDLE/site.tar.xz" -C "$WORK/site.new" && mv "$WORK/site.new" "$WORK/site"
fi
if [ ! -d "$WORK/srv" ]; then
    mkdir -p "$WORK/srv.new" && tar -xJf "$BUNDLE/srv.tar.xz" -C "$WORK/srv.new" && mv "$WORK/srv.new" "$WORK/srv"
    chmod -R a+rX "$WORK/srv"
fi
SRV=$WORK/srv
PGBIN=$SRV/usr/lib/postgresql/15/bin
if [ ! -e /usr/share/zoneinfo/UTC ]; then mkdir -p /usr/share/zoneinfo && cp -a "$SRV/zoneinfo/." /usr/share/zoneinfo/; fi
export TZ=UTC
server_env=(env "LD_LIBRARY_PATH=$SRV/lib")
for binary in "$PGBIN/postgres" "$PGBIN/initdb" "$SRV/bin/redis-server"; do
    if "${server_env[@]}" ldd "$binary" | grep "not found"; then echo "missing libraries for $binary" >&2; exit 1; fi
done

id "$PG_USER" >/dev/null 2>&1 || useradd --system --no-create-home "$PG_USER"
as_pg=(setpriv --reuid="$PG_USER" --regid="$(id -g "$PG_USER")" --init-groups "${server_env[@]}")
PGDATA=$WORK/pgdata
if [ ! -d "$PGDATA" ]; then
    install -d -o "$PG_USER" -m 700 "$PGDATA"
    "${as_pg[@]}" "$PGBIN/initdb" -D "$PGDATA" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >"$OUT/initdb.log" 2>&1 \
        || "${as_pg[@]}" "$PGBIN/initdb" -D "$PGDATA" -U postgres --auth=trust -E UTF8 --locale=C >"$OUT/initdb.log" 2>&1
fi
install -d -o "$PG_USER" -m 755 "$WORK/pgsocket"
if [ -f "$PGDATA/postmaster.pid" ]; then  # a server of an interrupted run: stop it (fast shutdown) first
    old=$(head -n 1 "$PGDATA/postmaster.pid")
    kill -INT "$old" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.2; done
fi
# As a deployment would configure it for a site of a few workers; jit off (its library is not carried).
"${as_pg[@]}" "$PGBIN/postgres" -D "$PGDATA" -p "$PG_PORT" -c listen_addresses=127.0.0.1 \
    -c unix_socket_directories="$WORK/pgsocket" -c max_connections=200 -c shared_buffers=1GB -c jit=off \
    >"$OUT/postgres.log" 2>&1 &
PG_PID=$!
"${server_env[@]}" "$SRV/bin/redis-server" --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
    >"$OUT/redis.log" 2>&1 &
REDIS_PID=$!
stop() { kill "$PG_PID" "$REDIS_PID" 2>/dev/null || true; wait "$PG_PID" "$REDIS_PID" 2>/dev/null || true; }
trap stop EXIT

export PYTHONPATH=$WORK/site:$PWD/agent:$PWD/inject
for _ in $(seq 100); do
    kill -0 "$PG_PID" 2>/dev/null || { echo "PostgreSQL did not start:" >&2; tail -n 5 "$OUT/postgres.log" >&2; exit 1; }
    "$PYTHON" -c "import psycopg; psycopg.connect('postgres://postgres@127.0.0.1:$PG_PORT/postgres').close()" \
        2>/dev/null && break
    sleep 0.2
done
DB=bench_$$
"$PYTHON" -c "
import psycopg
with psycopg.connect('postgres://postgres@127.0.0.1:$PG_PORT/postgres', autocommit=True) as conn:
    conn.execute('CREATE DATABASE $DB')
"
export BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/$DB BENCH_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0
(while sleep 5; do echo "$(date -u +%T) $(cat /proc/loadavg)"; done) >"$OUT/loadavg.txt" &
LOAD_PID=$!
echo "host: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), load $(cut -d' ' -f1-3 /proc/loadavg)"
PYTHONUNBUFFERED=1 "$PYTHON" "${BENCH:-bench/site_ingest.py}" "$@" 2>&1 | tee -a "$OUT/bench.txt"
status=${PIPESTATUS[0]}
kill "$LOAD_PID" 2>/dev/null || true
echo "host load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
exit "$status"
