#!/usr/bin/env bash
# The README's first command: set up, build, and run the main demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target shared_inbox
exec build/default/examples/shared_inbox "$@"
