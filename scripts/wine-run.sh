#!/usr/bin/env bash
# Runs a Windows program under Wine, headless: the windows preset's
# CMAKE_CROSSCOMPILING_EMULATOR, so ctest runs each test this way. One Wine
# prefix per user (DIBS_WINEPREFIX chooses another), made on first use; no
# window, no Wine debug output.
set -euo pipefail
if ! command -v wine > /dev/null; then
  echo "wine-run.sh: Wine is not installed: run scripts/install-deps.sh windows" >&2
  exit 127
fi
prefix=${DIBS_WINEPREFIX:-${TMPDIR:-/tmp}/dibs-wine-$(id -u)}
export WINEPREFIX=$prefix WINEDEBUG=-all WINEDLLOVERRIDES="mscoree,mshtml=" DISPLAY=
if [ ! -f "$prefix/system.reg" ]; then
  # Made once, under a lock: ctest starts tests side by side.
  mkdir -p "$(dirname "$prefix")"
  (
    flock 9
    if [ ! -f "$prefix/system.reg" ]; then
      wine wineboot --init > /dev/null 2>&1 || true
      wineserver -w
    fi
  ) 9> "$prefix.lock"
fi
# A wineserver up and the prefix's services started before any program runs,
# by one process at a time: ctest starts four Windows tests at once, and the
# first ones of a run that came to a cold Wine (no wineserver yet) hung now
# and then, a test that had passed every check never exiting (three in one
# timing run). The server then stays 30 s after its last program, not 3,
# so the suite does not start it again and again. `wineserver -p30` exits 2
# without doing anything when a server runs already. Neither the server nor
# what wineboot starts may keep the lock's descriptor (9>&-): they outlive
# this script, and would hold the lock until the server ends.
(
  flock 9
  rc=0
  wineserver -p30 9>&- || rc=$?
  if [ "$rc" -eq 0 ]; then
    wine wineboot > /dev/null 2>&1 9>&- || true
  fi
) 9> "$prefix.lock"
# The Dovecot of the ctest fixture `imap` (scripts/imap.sh): its host, port,
# user and password, as environment variables the Windows program reads.
if [ -n "${DIBS_IMAP_DIR:-}" ] && [ -f "$DIBS_IMAP_DIR/env" ]; then
  set -a
  # shellcheck disable=SC1091
  . "$DIBS_IMAP_DIR/env"
  set +a
fi
exec wine "$@"
