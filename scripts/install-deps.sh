#!/usr/bin/env bash
# Installs, with apt-get, whatever dibs needs to build and test that this
# Debian 12 machine does not have yet. Safe to run again: it only installs
# what is missing, and runs `apt-get update` only when something is.
set -euo pipefail

packages=(
  cmake ninja-build g++ clang libclang-rt-14-dev   # toolchains (clang for the sanitizer preset)
  libboost-dev libfmt-dev                          # the core's dependencies
  libsqlite3-dev                                   # dibs::sqlite
  libpq-dev postgresql                             # dibs::postgres, and the server its tests start (scripts/pg.sh)
  catch2 libbenchmark-dev                          # tests and benchmarks
  libcli11-dev                                     # the dibs command's argument parsing (tools/)
  bats util-linux                                  # the dibs command's tests (tests/cli), flock(1) among them
  liblockfile-bin                                  # dotlockfile(1): dot_lock_test's foreign lock holder
  libssl-dev                                       # dibs::imap: TLS (STARTTLS, port 993) through OpenSSL
  dovecot-imapd openssl                            # dibs::imap: the server its tests start (scripts/imap.sh),
                                                   # and the CLI that makes its test certificates (--tls)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "dibs: installing missing packages: ${missing[*]}"
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then sudo=(sudo); fi
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
