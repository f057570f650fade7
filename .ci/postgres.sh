#!/usr/bin/env bash
# Start or stop a throwaway PostgreSQL server for the test suite.
#   .ci/postgres.sh start DIR PORT   installs Debian's postgresql when missing (needs root),
#                                    starts a server with its data under DIR, prints its URL;
#                                    PORT "auto" takes a free one (another server may hold any
#                                    fixed port, e.g. a second checkout's test run)
#   .ci/postgres.sh stop DIR         stops it (a no-op when none runs)
set -euo pipefail
action=$1
dir=$2
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)

as_postgres() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

if [ "$action" = stop ]; then
    if [ -n "$bin" ] && [ -f "$dir/data/postmaster.pid" ]; then
        as_postgres "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null
    fi
    rm -rf "$dir"
    exit 0
fi

port=$3
if [ "$port" = auto ]; then
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
if [ -z "$bin" ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "PostgreSQL is not installed and cannot be installed here (needs root and apt-get)" >&2
        exit 1
    fi
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
fi
rm -rf "$dir"
mkdir -p "$dir"
[ "$(id -u)" = 0 ] && chown postgres "$dir"
as_postgres "$bin/initdb" -D "$dir/data" -A trust -U postgres >/dev/null
as_postgres "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w \
    -o "-p $port -k $dir -c listen_addresses=127.0.0.1" start >/dev/null
as_postgres "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres swarmtrain_test
echo "postgresql+psycopg://postgres@127.0.0.1:$port/swarmtrain_test"
