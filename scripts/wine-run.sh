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
# The Dovecot of the ctest fixture `imap` (scripts/imap.sh): its host, port,
# user and password, as environment variables the Windows program reads.
if [ -n "${DIBS_IMAP_DIR:-}" ] && [ -f "$DIBS_IMAP_DIR/env" ]; then
  set -a
  # shellcheck disable=SC1091
  . "$DIBS_IMAP_DIR/env"
  set +a
fi
# The program's output goes to files, copied out when it ends. The first
# Windows program of a Wine session starts Wine's own processes
# (services.exe, explorer.exe, winedevice.exe, rpcss.exe ...), which inherit
# its standard error and live until the session ends. Were that ctest's
# pipe, ctest would wait for them to close it, after the test had ended:
# as long as other tests kept the session alive, up to the test's timeout
# (the "hangs" of Windows tests at the start of a run, each 120 s, whose
# output said "All tests passed").
out=$(mktemp "${TMPDIR:-/tmp}/wine-run-out.XXXXXX")
err=$(mktemp "${TMPDIR:-/tmp}/wine-run-err.XXXXXX")
trap 'rm -f "$out" "$err"' EXIT
rc=0
wine "$@" > "$out" 2> "$err" || rc=$?
cat "$out"
cat "$err" >&2
exit "$rc"
