#!/usr/bin/env bash
# A throwaway Redis server on loopback, for dibs's tests, benchmarks and
# demo. DIR holds what clients need (url, port, password) and the server's
# own files (redis.conf, the append-only file under data/, server.log).
#
#   scripts/redis.sh start DIR [--fsync always|everysec|no] [--replica-of PRIMARY_DIR]
#                                 start on a free 127.0.0.1 port (the same one
#                                 again if DIR had a server); writes DIR/url
#   scripts/redis.sh stop DIR [--keep]
#                                 SHUTDOWN NOSAVE (waits), then removes DIR's
#                                 data (kept with --keep)
#   scripts/redis.sh kill DIR     SIGKILL the server (a crash), then wait until it is gone
#   scripts/redis.sh restart DIR  start again on the same data and port
#   scripts/redis.sh promote DIR  REPLICAOF NO ONE: the replica becomes a primary
#   scripts/redis.sh env DIR      prints DIBS_REDIS_URL to eval
#
# The server keeps an append-only file (appendonly yes) with the fsync
# policy asked for (default: always, which is what an acquire that must
# survive a crash of the server needs; see docs/stores.md). A server killed
# with SIGKILL loses nothing acknowledged under any policy (what it wrote is
# in the kernel's page cache); only a crash of the machine tells them apart.
# A password is always required (requirepass): the URL carries it.
set -euo pipefail

die() { echo "redis.sh: $*" >&2; exit 1; }

server_bin() {
  command -v redis-server >/dev/null 2>&1 || die "no redis-server (apt-get install redis-server, or scripts/install-deps.sh redis)"
  command -v redis-server
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

cli() {  # DIR ARGS...: redis-cli against DIR's server
  local d=$1
  shift
  REDISCLI_AUTH=$(cat "$d/password") redis-cli -h 127.0.0.1 -p "$(cat "$d/port")" "$@"
}

wait_ready() {  # DIR: 0 once it answers; 2 if it could not listen on its port (taken meanwhile)
  for _ in $(seq 1 300); do
    [ "$(cli "$1" PING 2>/dev/null)" = PONG ] && return 0
    # It daemonizes before it binds: a port another process took after
    # port_free looked is only in its log, and the server has ended.
    if grep -qs 'Failed listening on port' "$1/server.log"; then return 2; fi
    sleep 0.1
  done
  die "server in $1 not ready on port $(cat "$1/port") after 30 s (tail of $1/server.log: $(tail -n 3 "$1/server.log" 2>/dev/null | tr '\n' ' '))"
}

write_conf() {  # DIR PORT FSYNC [PRIMARY_DIR]
  local d=$1 port=$2 fsync=$3 primary=${4:-}
  {
    echo "bind 127.0.0.1"
    echo "port $port"
    echo "protected-mode yes"
    echo "daemonize yes"
    echo "pidfile $d/redis.pid"
    echo "logfile $d/server.log"
    echo "dir $d/data"
    echo "requirepass $(cat "$d/password")"
    echo "appendonly yes"
    echo "appendfsync $fsync"
    echo "save \"\""
    echo "maxclients 1000"
    if [ -n "$primary" ]; then
      echo "replicaof 127.0.0.1 $(cat "$primary/port")"
      echo "masterauth $(cat "$primary/password")"
      echo "replica-read-only yes"
    fi
  } >"$d/redis.conf"
}

start_server() {  # DIR
  "$(server_bin)" "$1/redis.conf" >/dev/null 2>&1
}

cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || die "usage: redis.sh start|stop|kill|restart|promote|env DIR [--fsync always|everysec|no] [--replica-of PRIMARY_DIR]"
shift 2 || true

case "$cmd" in
start)
  fsync=always primary=
  while [ $# -gt 0 ]; do
    case "$1" in
      --fsync) fsync=${2:-}; shift 2 ;;
      --replica-of) primary=$(cd "${2:-}" && pwd); shift 2 ;;
      *) die "start: unknown option '$1'" ;;
    esac
  done
  case "$fsync" in always | everysec | no) ;; *) die "--fsync: '$fsync' is not one of always, everysec, no" ;; esac
  [ -z "$primary" ] || [ -f "$primary/port" ] || die "--replica-of: no server in '$primary'"
  mkdir -p "$dir/data"
  dir=$(cd "$dir" && pwd)
  # A server still running here (a run that was interrupted): stopped
  # first, so that this start is what the caller gets.
  if [ -f "$dir/redis.pid" ] && kill -0 "$(cat "$dir/redis.pid")" 2>/dev/null; then
    "$0" stop "$dir" --keep
  fi
  [ -f "$dir/password" ] || head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/password"
  for _ in $(seq 1 50); do
    # Below Linux's ephemeral range (32768 up), where no client's socket
    # takes the port between this look and the server's bind.
    port=$((20000 + RANDOM % 12000))
    port_free "$port" || continue
    write_conf "$dir" "$port" "$fsync" "$primary"
    echo "$port" >"$dir/port"
    : >"$dir/server.log"
    if start_server "$dir"; then
      rc=0
      wait_ready "$dir" || rc=$?
      [ "$rc" -eq 2 ] && continue  # taken meanwhile (another test's server): another port
      if [ -n "$primary" ]; then  # a replica: ready once it has its primary's data
        for _ in $(seq 1 300); do
          cli "$dir" INFO replication 2>/dev/null | grep -q '^master_link_status:up' && break
          sleep 0.1
        done
        cli "$dir" INFO replication | grep -q '^master_link_status:up' || die "replica in $dir not in sync with $primary after 30 s"
      fi
      echo "redis://default:$(cat "$dir/password")@127.0.0.1:$port" >"$dir/url"
      exit 0
    fi
  done
  die "could not start a server in $dir (see $dir/server.log)"
  ;;
stop)
  [ -f "$dir/port" ] || exit 0
  if [ -f "$dir/redis.pid" ] && pid=$(cat "$dir/redis.pid") && kill -0 "$pid" 2>/dev/null; then
    cli "$dir" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  [ "${1:-}" = "--keep" ] || rm -rf "$dir/data" "$dir/url" "$dir/port" "$dir/redis.pid" "$dir/redis.conf"
  ;;
kill)
  pid=$(cat "$dir/redis.pid" 2>/dev/null) || die "no server running in $dir"
  kill -KILL "$pid" 2>/dev/null || die "no server running in $dir (pid $pid)"
  for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.02; done
  rm -f "$dir/redis.pid"
  ;;
restart)
  [ -f "$dir/redis.conf" ] || die "no server was started in $dir"
  for _ in $(seq 1 100); do
    # The log of this try alone (wait_ready reads it), the earlier ones kept.
    cat "$dir/server.log" >>"$dir/server.log.old" 2>/dev/null || true
    : >"$dir/server.log"
    if start_server "$dir"; then
      rc=0
      wait_ready "$dir" || rc=$?
      [ "$rc" -eq 0 ] && exit 0
    fi
    sleep 0.2  # the port still held by the killed server's socket
  done
  die "could not restart the server in $dir (see $dir/server.log)"
  ;;
promote)
  [ "$(cli "$dir" REPLICAOF NO ONE)" = OK ] || die "REPLICAOF NO ONE refused by the server in $dir"
  # What a restart of this server must keep: it is a primary now.
  sed -i '/^replicaof /d; /^masterauth /d; /^replica-read-only /d' "$dir/redis.conf"
  ;;
env)
  echo "export DIBS_REDIS_URL=$(cat "$dir/url")"
  ;;
*)
  die "unknown command '$cmd'"
  ;;
esac
