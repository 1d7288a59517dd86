#!/usr/bin/env bash
# A throwaway PostgreSQL server on loopback, for dibs's tests, benchmarks and
# demo. DIR holds what clients need (conninfo, port, password); the cluster
# itself lives in a directory of its own under $TMPDIR (named in DIR/home),
# which the server's owner can reach wherever DIR is. When run as root the
# owner is a system user `dibs-pg`, made once (initdb refuses to run as
# root); otherwise it is this user.
#
#   scripts/pg.sh start DIR [--durable]  initdb (if DIR has no cluster), start on a
#                                        free 127.0.0.1 port; writes DIR/conninfo
#   scripts/pg.sh stop DIR [--keep]      fast shutdown (waits), then removes the
#                                        cluster (kept with --keep)
#   scripts/pg.sh kill DIR               SIGKILL the postmaster (a crash), then wait
#                                        until its backends are gone too
#   scripts/pg.sh restart DIR            start again on the same data and port
#   scripts/pg.sh env DIR                prints PG* variables to eval
#
# DIR/conninfo is a libpq connection string for the role `dibs` (password
# in it: the server also refuses a wrong one) and the database `dibs`.
# Without --durable the server runs with fsync=off: a process crash (what
# the tests make) loses nothing, since written WAL is in the kernel's page
# cache; only a crash of the machine could. Benchmarks pass --durable.
set -euo pipefail

die() { echo "pg.sh: $*" >&2; exit 1; }

bindir() {
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  [ -n "$d" ] && [ -x "$d/initdb" ] || die "no PostgreSQL server found under /usr/lib/postgresql (apt-get install postgresql)"
  echo "$d"
}

# Runs a command as the server's owner: this user, or dibs-pg when root.
as_owner() {
  if [ "$(id -u)" -eq 0 ]; then
    runuser -u dibs-pg -- "$@"
  else
    "$@"
  fi
}

ensure_owner() {
  [ "$(id -u)" -eq 0 ] || return 0
  id -u dibs-pg >/dev/null 2>&1 ||
    useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin dibs-pg
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start_server() {  # HOME PORT
  local home=$1 port=$2 bin
  bin=$(bindir)
  as_owner "$bin/pg_ctl" -D "$home/data" -l "$home/server.log" -w -t 60 -s \
    -o "-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories='$home' -c max_connections=200 $(cat "$home/settings")" \
    start >/dev/null
}

wait_ready() {  # DIR PORT
  local bin
  bin=$(bindir)
  for _ in $(seq 1 300); do
    "$bin/pg_isready" -q -h 127.0.0.1 -p "$2" && return 0
    sleep 0.1
  done
  die "server in $1 not ready on port $2 after 30 s (see $1/server.log)"
}

cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || die "usage: pg.sh start|stop|kill|restart|env DIR [--durable]"

case "$cmd" in
start)
  ensure_owner
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  if [ ! -f "$dir/home" ] || [ ! -f "$(cat "$dir/home")/data/PG_VERSION" ]; then
    bin=$(bindir)
    home=$(mktemp -d "${TMPDIR:-/tmp}/dibs-pg.XXXXXX")
    chmod 0755 "$home"
    password=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')
    echo "$password" >"$home/password"
    if [ "${3:-}" = "--durable" ]; then echo "" >"$home/settings"; else echo "-c fsync=off" >"$home/settings"; fi
    [ "$(id -u)" -ne 0 ] || chown -R dibs-pg "$home"
    as_owner "$bin/initdb" -D "$home/data" -U dibs --pwfile="$home/password" --auth-local=trust \
      --auth-host=scram-sha-256 -E UTF8 --locale=C.UTF-8 >"$home/initdb.log" 2>&1 ||
      die "initdb failed (see $home/initdb.log)"
    echo "$home" >"$dir/home"
    cp "$home/password" "$dir/password"
  fi
  home=$(cat "$dir/home")
  # A server still running on this cluster (a run that was interrupted):
  # stop it first, so that this start is what the caller gets.
  if as_owner "$(bindir)/pg_ctl" -D "$home/data" status >/dev/null 2>&1; then
    as_owner "$(bindir)/pg_ctl" -D "$home/data" -m fast -w -t 60 -s stop || true
  fi
  for _ in $(seq 1 50); do
    port=$((20000 + RANDOM % 12000))  # below the ephemeral range (32768 up)
    port_free "$port" || continue
    if start_server "$home" "$port" 2>"$home/start.err"; then
      echo "$port" >"$dir/port"
      wait_ready "$home" "$port"
      as_owner "$(bindir)/psql" -q -h "$home" -p "$port" -U dibs -d postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = 'dibs'" | grep -q 1 ||
        as_owner "$(bindir)/createdb" -h "$home" -p "$port" -U dibs dibs
      echo "host=127.0.0.1 port=$port user=dibs password=$(cat "$dir/password") dbname=dibs connect_timeout=10" >"$dir/conninfo"
      exit 0
    fi
  done
  die "could not start a server in $home: $(tail -n 3 "$home/start.err" 2>/dev/null | tr '\n' ' ')(see $home/server.log)"
  ;;
stop)
  [ -f "$dir/home" ] || exit 0
  home=$(cat "$dir/home")
  if [ -f "$home/data/postmaster.pid" ]; then
    as_owner "$(bindir)/pg_ctl" -D "$home/data" -m fast -w -t 60 -s stop || true
  fi
  [ "${3:-}" = "--keep" ] || rm -rf "$home" "$dir/home"
  ;;
kill)
  home=$(cat "$dir/home")
  pid=$(head -n 1 "$home/data/postmaster.pid" 2>/dev/null) || die "no server running in $home"
  # Its children (the backends), from /proc: procps is not in every base image.
  children=$(grep -ls "^PPid:[[:space:]]*$pid\$" /proc/[0-9]*/status 2>/dev/null | cut -d/ -f3 || true)
  kill -KILL "$pid"
  # Its backends notice that the postmaster is gone and exit; the data
  # directory can be started again only once they all have.
  for _ in $(seq 1 300); do
    alive=0
    for p in $pid $children; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" -eq 1 ] || break
    sleep 0.1
  done
  ;;
restart)
  home=$(cat "$dir/home")
  port=$(cat "$dir/port")
  for _ in $(seq 1 100); do
    if start_server "$home" "$port" 2>/dev/null; then
      wait_ready "$home" "$port"
      exit 0
    fi
    sleep 0.2  # old backends still hold its shared memory: "postmaster.pid already exists"
  done
  die "could not restart the server in $home (see $home/server.log)"
  ;;
env)
  echo "export PGHOST=127.0.0.1 PGPORT=$(cat "$dir/port") PGUSER=dibs PGPASSWORD=$(cat "$dir/password") PGDATABASE=dibs"
  ;;
*)
  die "unknown command '$cmd'"
  ;;
esac
