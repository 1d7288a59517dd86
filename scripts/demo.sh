#!/usr/bin/env bash
# The README's first command: set up, build, and run the main demo.
#
#   scripts/demo.sh [--store postgres|imap|redis] [shared_inbox options]
#
# With --store postgres (and no --pg or $DIBS_PG_CONNINFO) it starts a
# throwaway PostgreSQL on loopback for the run (scripts/pg.sh) and stops it
# at the end; so does --store redis (and no --redis or $DIBS_REDIS_URL) with
# a throwaway Redis (scripts/redis.sh). With --store imap (and no $DIBS_IMAP_HOST) it starts a
# throwaway Dovecot on loopback (scripts/imap.sh) the same way. With
# $DIBS_IMAP_HOST set it uses that server: one that takes OAuth2 tokens only
# (Exchange Online, Gmail) with --imap-token-cmd CMD (CMD prints an access
# token) and, for a shared mailbox, --imap-authzid ADDR, and the claims in
# SQLite (--imap-claims sqlite: such servers lack QRESYNC), e.g.
#   DIBS_IMAP_HOST=outlook.office365.com DIBS_IMAP_TLS=implicit DIBS_IMAP_USER=me@example.com \
#     scripts/demo.sh --store imap --imap-claims sqlite --imap-token-cmd 'oauth2-helper --account work' \
#                     --imap-authzid shared@example.com
#
# It installs only what the demo uses (scripts/install-deps.sh demo): no
# server for the SQLite demo; PostgreSQL or Dovecot only for their --store,
# and then never as a running or enabled system service.
set -euo pipefail
cd "$(dirname "$0")/.."
store=sqlite given=0 prev=
for a in "$@"; do
  case $prev in --store) store=$a ;; esac
  case $a in --store=*) store=${a#--store=} ;; --pg | --pg=* | --redis | --redis=*) given=1 ;; esac
  prev=$a
done
groups=(demo)
if [ "$store" = postgres ] && [ "$given" = 0 ] && [ -z "${DIBS_PG_CONNINFO:-}" ]; then groups+=(postgres); fi
if [ "$store" = imap ] && [ -z "${DIBS_IMAP_HOST:-}" ]; then groups+=(imap); fi
if [ "$store" = redis ] && [ "$given" = 0 ] && [ -z "${DIBS_REDIS_URL:-}" ]; then groups+=(redis); fi
scripts/install-deps.sh "${groups[@]}"
cmake --preset demo >/dev/null
cmake --build --preset demo --target shared_inbox
demo=build/demo/examples/shared_inbox
# with_server KIND NAME VARIABLE FILE: starts a throwaway server of
# scripts/KIND.sh (stopped and removed at exit) and runs the demo with
# VARIABLE set to the server's FILE (how to reach it).
with_server() {
  local kind=$1 name=$2 variable=$3 file=$4
  server=$(mktemp -d "${TMPDIR:-/tmp}/dibs-demo-$kind.XXXXXX")
  trap 'scripts/'"$kind"'.sh stop "$server"; rm -rf "$server"' EXIT
  echo "starting a throwaway $name server (scripts/$kind.sh) ..."
  "scripts/$kind.sh" start "$server"
  env "$variable=$(cat "$server/$file")" "$demo" "${args[@]}"
}
args=("$@")
if [ "$store" = postgres ] && [ "$given" = 0 ] && [ -z "${DIBS_PG_CONNINFO:-}" ]; then
  with_server pg PostgreSQL DIBS_PG_CONNINFO conninfo
  exit
fi
if [ "$store" = redis ] && [ "$given" = 0 ] && [ -z "${DIBS_REDIS_URL:-}" ]; then
  with_server redis Redis DIBS_REDIS_URL url
  exit
fi
if [ "$store" = imap ] && [ -z "${DIBS_IMAP_HOST:-}" ]; then
  server=$(mktemp -d "${TMPDIR:-/tmp}/dibs-demo-imap.XXXXXX")
  chmod 0755 "$server"  # Dovecot's mail user (not root) keeps its files there
  # shellcheck disable=SC2016
  trap 'scripts/imap.sh stop "$server"; home=$(cat "$server/home" 2>/dev/null || true)
        [ -n "$home" ] && [ "$home" != "$server" ] && rm -rf "$home"; rm -rf "$server"' EXIT
  echo "starting a throwaway Dovecot IMAP server (scripts/imap.sh) ..."
  scripts/imap.sh start "$server" >/dev/null
  (set -a && . "$server/env" && exec "$demo" "$@")
  exit
fi
exec "$demo" "$@"
