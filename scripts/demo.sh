#!/usr/bin/env bash
# The README's first command: set up, build, and run the main demo.
#
#   scripts/demo.sh [--store postgres] [shared_inbox options]
#
# With --store postgres (and no --pg or $DIBS_PG_CONNINFO) it starts a
# throwaway PostgreSQL on loopback for the run (scripts/pg.sh) and stops it
# at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target shared_inbox
postgres=0 given=0
for a in "$@"; do
  [ "$a" = postgres ] && postgres=1
  [ "$a" = --pg ] && given=1
done
if [ "$postgres" = 1 ] && [ "$given" = 0 ] && [ -z "${DIBS_PG_CONNINFO:-}" ]; then
  server=$(mktemp -d "${TMPDIR:-/tmp}/dibs-demo-pg.XXXXXX")
  trap 'scripts/pg.sh stop "$server"; rm -rf "$server"' EXIT
  echo "starting a throwaway PostgreSQL server (scripts/pg.sh) ..."
  scripts/pg.sh start "$server"
  DIBS_PG_CONNINFO=$(cat "$server/conninfo") build/default/examples/shared_inbox "$@"
  exit
fi
exec build/default/examples/shared_inbox "$@"
