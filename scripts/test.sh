#!/usr/bin/env bash
# The README's second command: set up, build, and run every test.
# With an argument, runs that workflow preset instead of the default one
# (asan, tsan, debug, windows, windows-debug); see CMakePresets.json.
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what this preset builds and runs with: the default one needs no clang,
# no Wine and no mingw-w64.
scripts/install-deps.sh --preset "${1:-default}"
exec cmake --workflow --preset "${1:-default}"
