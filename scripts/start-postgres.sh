#!/usr/bin/env bash
# Start a throwaway PostgreSQL server for the tests and print its URL (the only line on stdout).
#
#   export LLMVISOR_TEST_POSTGRES_URL="$(bash scripts/start-postgres.sh)"
#   ... run the tests ...
#   bash scripts/start-postgres.sh --stop "$LLMVISOR_TEST_POSTGRES_URL"
#
# Installs Debian's `postgresql` package if no server binaries are found (apt-get update first), then runs
# initdb in a fresh temporary directory as the `postgres` user (as the current user when not root), starts
# the server on a free loopback port with trust authentication, and creates the database `llmvisor_test`.
# Loopback only; nothing else can reach it. `--stop URL` stops the server this script started for that URL
# and removes its directory; plain `--stop` stops the one it last started (and not yet stopped), which on a
# machine where several sessions start servers may be another session's: give the URL.
set -euo pipefail

STATE_FILE="${TMPDIR:-/tmp}/llmvisor-test-postgres.dir"
DATABASE="llmvisor_test"

log() { echo "start-postgres: $*" >&2; }

find_bindir() {
    local dir
    for dir in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
        if [[ -x "$dir/initdb" && -x "$dir/pg_ctl" ]]; then
            echo "$dir"
            return 0
        fi
    done
    return 1
}

as_owner() {
    if [[ $EUID -eq 0 ]]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

if [[ "${1:-}" == "--stop" ]]; then
    # The state file lists the servers started, one data directory a line; stop the one serving the URL's
    # port (its postmaster.pid names the port on line 4), else the latest.
    datadir=""
    if [[ -s "$STATE_FILE" ]]; then
        if [[ -n "${2:-}" ]]; then
            port="$(sed -E 's#.*@[^:/]+:([0-9]+)/.*#\1#' <<<"$2")"
            while read -r candidate; do
                if [[ "$(sed -n 4p "$candidate/postmaster.pid" 2>/dev/null)" == "$port" ]]; then
                    datadir="$candidate"
                fi
            done <"$STATE_FILE"
        else
            datadir="$(tail -n 1 "$STATE_FILE")"
        fi
    fi
    if [[ -z "$datadir" ]]; then
        log "no server started by this script is recorded in $STATE_FILE${2:+ for $2}"
        exit 0
    fi
    bindir="$(find_bindir)"
    as_owner "$bindir/pg_ctl" -D "$datadir" -m fast -w stop >&2 || true
    rm -rf "$datadir"
    grep -vxF "$datadir" "$STATE_FILE" >"$STATE_FILE.tmp" || true
    mv "$STATE_FILE.tmp" "$STATE_FILE"
    [[ -s "$STATE_FILE" ]] || rm -f "$STATE_FILE"
    log "stopped and removed $datadir"
    exit 0
fi

if ! bindir="$(find_bindir)"; then
    if [[ $EUID -ne 0 ]]; then
        log "PostgreSQL server binaries not found and not root: install Debian's 'postgresql' package"
        exit 1
    fi
    log "installing Debian's postgresql package"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -qq --no-install-recommends postgresql >&2; then
        apt-get update -qq >&2
        apt-get install -y -qq --no-install-recommends postgresql >&2
    fi
    bindir="$(find_bindir)"
fi

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
port=""
for candidate in $(seq 54320 54399); do
    if ! port_in_use "$candidate"; then
        port="$candidate"
        break
    fi
done
if [[ -z "$port" ]]; then
    log "no free port in 54320-54399"
    exit 1
fi

datadir="$(mktemp -d "${TMPDIR:-/tmp}/llmvisor-postgres.XXXXXX")"
chmod 700 "$datadir"
if [[ $EUID -eq 0 ]]; then
    chown postgres:postgres "$datadir"
fi
user="$(as_owner id -un)"
as_owner "$bindir/initdb" -D "$datadir" -U "$user" --auth=trust -E UTF8 --locale=C.UTF-8 --no-sync >/dev/null
as_owner "$bindir/pg_ctl" -D "$datadir" -l "$datadir/server.log" -w -t 60 \
    -o "-p $port -c listen_addresses=127.0.0.1 -k $datadir -c max_connections=100" start >&2
as_owner "$bindir/createdb" -h 127.0.0.1 -p "$port" -U "$user" "$DATABASE"
echo "$datadir" >> "$STATE_FILE"
log "PostgreSQL $("$bindir/postgres" --version | awk '{print $3}') on 127.0.0.1:$port, data in $datadir (stop: bash scripts/start-postgres.sh --stop)"
echo "postgresql+psycopg://$user@127.0.0.1:$port/$DATABASE"
