#!/usr/bin/env bats
# scripts/install-deps.sh: each command installs only what it uses.

deps() { "$BATS_TEST_DIRNAME/../../scripts/install-deps.sh" "$@"; }

@test "the plain demo installs no server" {
  run deps --list demo
  [ "$status" -eq 0 ]
  [ -n "$output" ]
  for server in postgresql postgresql-15 dovecot-imapd dovecot-core; do
    if grep -qx "$server" <<<"$output"; then
      echo "the demo group installs $server" >&2
      return 1
    fi
  done
  grep -qx libsqlite3-dev <<<"$output"
}

@test "a server comes only with the group that starts it" {
  run deps --list postgres
  [ "$status" -eq 0 ]
  [ "$output" = postgresql ]
  run deps --list imap
  [ "$status" -eq 0 ]
  grep -qx dovecot-imapd <<<"$output"
  ! grep -qx postgresql <<<"$output"
}

@test "the test group is everything the others are" {
  run deps --list all
  [ "$status" -eq 0 ]
  all=$output
  run deps --list demo postgres imap windows
  for p in $output; do grep -qx "$p" <<<"$all"; done
  grep -qx wine64 <<<"$all"
  grep -qx bats <<<"$all"
  grep -qx catch2 <<<"$all"
}

@test "an unknown group is refused, naming it" {
  run deps --list nosuch
  [ "$status" -eq 64 ]
  [[ "$output" == *"unknown group 'nosuch'"* ]]
}

@test "a preset's tests install only what it builds and runs with" {
  run deps --list --preset default
  [ "$status" -eq 0 ]
  for p in wine wine64 g++-mingw-w64-x86-64-posix clang libbenchmark-dev; do
    if grep -qx "$p" <<<"$output"; then
      echo "the default preset installs $p" >&2
      return 1
    fi
  done
  for p in postgresql dovecot-imapd catch2 bats g++; do grep -qx "$p" <<<"$output"; done
  run deps --list --preset asan
  grep -qx libclang-rt-14-dev <<<"$output"
  ! grep -qx wine64 <<<"$output"
  run deps --list --preset windows
  grep -qx wine64 <<<"$output"
  grep -qx libcli11-dev <<<"$output"
  ! grep -qx postgresql <<<"$output"
  run deps --list --preset nosuch
  [ "$status" -eq 64 ]
  [[ "$output" == *"unknown preset 'nosuch'"* ]]
}
