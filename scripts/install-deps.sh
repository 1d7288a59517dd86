#!/usr/bin/env bash
# Installs, with apt-get, whatever dibs needs that this Debian 12 machine does
# not have yet. Safe to run again: it only installs what is missing, and runs
# `apt-get update` only when something is.
#
#   scripts/install-deps.sh [GROUP...]         install the groups (default: all)
#   scripts/install-deps.sh --preset NAME      install what that preset's tests need
#   scripts/install-deps.sh --list GROUP...    print their packages, install nothing
#
# Groups:
#   demo      what the main demo builds with (scripts/demo.sh): a compiler,
#             CMake, the core's headers and the adapters' client libraries
#   postgres  the PostgreSQL server that scripts/pg.sh starts (throwaway, loopback)
#   redis     the Redis server that scripts/redis.sh starts (throwaway, loopback)
#   imap      the Dovecot server that scripts/imap.sh starts (throwaway, loopback)
#   tests     what the Linux test suites build and run with, besides the
#             servers: Catch2, CLI11, bats and the foreign lock tools
#   clang     clang++ and its sanitizer runtimes, and Google Benchmark (the
#             clang and asan presets; the asan preset builds the benchmarks)
#   windows   the Windows cross build and Wine to run its tests
#             (scripts/test.sh windows), and npm if there is none, which
#             fetches SQLite's amalgamation for it
#   peers     what benchmarks/run_queue_peers.sh runs the other projects with:
#             Node.js and npm (graphile-worker comes from npm into the build
#             directory); no test needs it, so `all` leaves it out
#   all       everything the tests and benchmarks of every preset need
#
# scripts/test.sh installs only the groups of the preset it runs
# (scripts/install-deps.sh --preset NAME prints them): the default preset
# needs no clang, no Wine and no mingw-w64.
#
# Server packages never leave a system service behind: on a machine with
# systemd, installing postgresql, redis-server or dovecot-imapd would create
# and start a cluster on port 5432, a Redis on port 6379 and a Dovecot on
# ports 143 and 993 on every interface, and enable them at boot. The packages are installed with
# service starts refused (policy-rc.d), and the services of the packages this
# script installed are disabled afterwards. dibs runs its own servers, as
# the user who runs the tests, from scripts/pg.sh and scripts/imap.sh.
set -euo pipefail

group_demo=(
  cmake ninja-build g++                            # the toolchain
  libboost-dev libfmt-dev                          # the core's dependencies
  libsqlite3-dev                                   # dibs::sqlite
  libpq-dev                                        # dibs::postgres (the client library only)
  libssl-dev                                       # dibs::imap: TLS (STARTTLS, port 993) through OpenSSL
  libhiredis-dev                                   # dibs::redis (the client library only)
)
group_postgres=(postgresql)                        # the server scripts/pg.sh starts
group_redis=(redis-server redis-tools)             # the server scripts/redis.sh starts, and redis-cli
group_imap=(
  dovecot-imapd                                    # the server scripts/imap.sh starts
  openssl                                          # the CLI that makes its test certificates (--tls) and OAuth2 key
  python3                                          # the IMAP tests' proxy and imaplib listing (tests/scripts)
)
group_windows=(
  cmake ninja-build libboost-dev libfmt-dev catch2  # the build, and the headers it takes from this machine
  libcli11-dev                                     # dibs.exe's argument parsing
  g++-mingw-w64-x86-64-posix                       # mingw-w64 with std::thread (the posix thread model)
  wine wine64                                      # runs the Windows tests (scripts/wine-run.sh)
)
# npm fetches SQLite's amalgamation for the cross build (cmake/sqlite-amalgamation.cmake).
# Debian's npm only where there is no npm at all: one that came with Node.js
# from elsewhere (nodesource, nvm) is used as it is, and Debian's would
# conflict with it.
if ! command -v npm > /dev/null; then group_windows+=(npm); fi
group_tests=(
  catch2                                           # the test programs
  libcli11-dev                                     # the dibs command's argument parsing (tools/)
  bats util-linux                                  # the dibs command's tests (tests/cli), flock(1) among them
  liblockfile-bin                                  # dotlockfile(1): dot_lock_test's and tests/cli's foreign lock holder
  procmail                                         # lockfile(1): tests/cli/lock_dot.bats
  stress-ng                                        # the load scripts/soak.sh runs the tests under
  faketime                                         # a host whose clock is a day off: tests/cli/postgres.bats
)
group_clang=(
  clang libclang-rt-14-dev                         # the clang and sanitizer presets
  libbenchmark-dev                                 # the benchmarks (built by the asan preset)
)
# Debian's Node.js (18 on Debian 12: graphile-worker 0.17 runs on it) and npm,
# each only where there is none at all, as for the windows group: a Node.js
# from elsewhere (nodesource, nvm) is used as it is.
group_peers=()
if ! command -v node > /dev/null; then group_peers+=(nodejs); fi
if ! command -v npm > /dev/null; then group_peers+=(npm); fi
group_all=(
  "${group_demo[@]}" "${group_postgres[@]}" "${group_redis[@]}" "${group_imap[@]}" "${group_tests[@]}" "${group_clang[@]}"
  "${group_windows[@]}"
)
# The groups each workflow preset of CMakePresets.json needs.
groups_of_preset() {
  case $1 in
    default | debug | dev | tsan) echo demo postgres redis imap tests ;;
    clang | asan | minsizerel) echo demo postgres redis imap tests clang ;;
    windows | windows-debug) echo windows imap ;;
    demo) echo demo ;;
    *) return 1 ;;
  esac
}
# The services a server package would start and enable.
services_of() {
  case $1 in
    postgresql) echo postgresql ;;
    dovecot-imapd) echo dovecot ;;
    redis-server) echo redis-server ;;
  esac
}

list=0
groups=()
while (($#)); do
  case $1 in
    --list) list=1 ;;
    --preset)
      if ! preset_groups=$(groups_of_preset "${2-}"); then
        echo "install-deps.sh: unknown preset '${2-}' (default, debug, clang, asan, tsan, minsizerel, windows, windows-debug, demo)" >&2
        exit 64
      fi
      read -ra more <<<"$preset_groups"
      groups+=("${more[@]}")
      shift ;;
    demo | postgres | redis | imap | tests | clang | windows | peers | all) groups+=("$1") ;;
    *) echo "install-deps.sh: unknown group '$1' (demo, postgres, redis, imap, tests, clang, windows, peers, all)" >&2; exit 64 ;;
  esac
  shift
done
((${#groups[@]})) || groups=(all)

packages=()
for g in "${groups[@]}"; do
  declare -n members="group_$g"
  for p in "${members[@]}"; do
    [[ " ${packages[*]} " == *" $p "* ]] || packages+=("$p")
  done
  unset -n members
done
if ((list)); then
  printf '%s\n' "${packages[@]}"
  exit 0
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done
((${#missing[@]})) || exit 0

echo "dibs: installing missing packages: ${missing[*]}"
sudo=()
if [ "$(id -u)" -ne 0 ]; then sudo=(sudo); fi

# Services to keep stopped and disabled: those the server packages being
# installed now bring (a service that was there before, from a package of
# its own such as dovecot-core, is left as it was).
services=()
for p in "${missing[@]}"; do
  s=$(services_of "$p")
  if [ -n "$s" ] && [ ! -e "/lib/systemd/system/$s.service" ] && [ ! -e "/etc/init.d/$s" ]; then
    services+=("$s")
  fi
done
policy=/usr/sbin/policy-rc.d
own_policy=0
if ((${#services[@]})) && [ ! -e "$policy" ]; then
  # invoke-rc.d and deb-systemd-invoke ask this before starting anything:
  # 101 means "not allowed", so the install starts no server.
  printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null
  "${sudo[@]}" chmod 0755 "$policy"
  own_policy=1
fi
cleanup() { if ((own_policy)); then "${sudo[@]}" rm -f "$policy"; fi; }
trap cleanup EXIT

"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"

for s in "${services[@]}"; do
  # Stop whatever started anyway (a policy-rc.d of the machine's own that
  # allows starts), then take the service out of the boot sequence, for
  # systemd (links made by deb-systemd-helper, whether systemd runs or not)
  # and for SysV init.
  if [ -d /run/systemd/system ]; then
    "${sudo[@]}" systemctl disable --now "$s.service" >/dev/null 2>&1 || true
  else
    "${sudo[@]}" service "$s" stop >/dev/null 2>&1 || true
  fi
  if command -v deb-systemd-helper >/dev/null; then
    "${sudo[@]}" deb-systemd-helper disable "$s.service" >/dev/null 2>&1 || true
  fi
  if command -v update-rc.d >/dev/null; then
    "${sudo[@]}" update-rc.d "$s" disable >/dev/null 2>&1 || true
  fi
  echo "dibs: $s installed, stopped and not enabled at boot (dibs starts its own throwaway servers)"
done
