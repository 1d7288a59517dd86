#!/usr/bin/env bats
# Keys, paths, COMMANDs and log lines are data, whatever they look like: a
# subcommand's options end at its first argument that is not an option, as
# flock(1)'s do.
load helpers
bats_require_minimum_version 1.5.0

# Journals "key argument" for each run: the key dibs claimed, the file it was
# started for.
handler() {
  cat > handle <<'SH'
#!/bin/sh
printf '%s %s\n' "$DIBS_KEY" "$1" >> journal
SH
  chmod +x handle
}

@test "the guide's xargs idiom over files named like options: each item claimed under its own name, handled once" {
  mkdir inbox claims
  handler
  names=(--next=order order-2 -x -q --lease=1s --help -- - plain)
  for n in "${names[@]}"; do : > "inbox/$n"; done
  ls inbox | xargs -I{} dibs claim dir:claims {} -- ./handle inbox/{}
  # Exactly one run per file, with its own key and its own file.
  [ "$(wc -l < journal)" -eq "${#names[@]}" ]
  for n in "${names[@]}"; do
    [ "$(grep -cxF -- "$n inbox/$n" journal)" -eq 1 ]
  done
  [ "$(dibs status --json dir:claims | grep -c '"state": "completed"')" -eq "${#names[@]}" ]
  # A second pass runs nothing: each is already completed (10), by its name.
  run sh -c 'ls inbox | xargs -I{} sh -c '\''dibs claim -q dir:claims "$1" -- ./handle "inbox/$1"; echo $?'\'' sh {}'
  [ "$(printf '%s\n' "$output" | grep -cx 10)" -eq "${#names[@]}" ]
  [ "$(wc -l < journal)" -eq "${#names[@]}" ]
}

@test "'--' before the data is accepted; a key that begins with '-' can be passed with or without it" {
  mkdir c
  handler
  run dibs claim -q -- dir:c -n -- ./handle one
  [ "$status" -eq 0 ]
  run dibs claim -q dir:c --max-attempts=1 -- ./handle two
  [ "$status" -eq 0 ]
  [ "$(cat journal)" = "$(printf -- '-n one\n--max-attempts=1 two')" ]
  # The option before STORE still works; the one after it is a key's text.
  run dibs claim --max-attempts 1 dir:c f -- sh -c 'exit 3'
  [ "$status" -eq 3 ]
  run dibs claim dir:c f -- true
  [ "$status" -eq 12 ]
}

@test "lock and retry: PATH and COMMAND's own arguments are never taken as dibs's options" {
  # flock(1)'s spelling without '--'; COMMAND's -c and --on are its own.
  run dibs lock x.lock sh -c 'echo "$0 $*"' --on 7
  [ "$status" -eq 0 ]
  [ "$output" = "--on 7" ]
  # A lock file whose name begins with '-': held by COMMAND while it runs.
  run dibs lock -w 1s -- -n.lock -- sh -c 'grep -c "^dibs-lease" ./-n.lock; exit 4'
  [ "$status" -eq 4 ]
  [ "$output" = 1 ]
  run dibs retry --attempts 3 sh -c 'echo run >> runs; echo "$0 $*"; exit 0' --on 0
  [ "$status" -eq 0 ]
  [ "$output" = "--on 0" ]
  [ "$(wc -l < runs)" -eq 1 ]
  # An option written after the data is data too, and dibs says so when it
  # cannot be run as COMMAND.
  run -127 dibs lock x.lock -n -- true
  [ "$status" -eq 127 ]
  [[ "$output" == *"options of dibs go before"* ]]
}

@test "dibs log PATH LINE: a line that looks like an option is written, exit 0 means it is in the log" {
  texts=(--help --keep=2 --timeout=1s --rotate-size=1 --sync=record -h -- "" "-- two words")
  for l in "${texts[@]}"; do
    run dibs log out.log "$l"
    [ "$status" -eq 0 ]
    [ -z "$output" ]
  done
  # Exactly these lines, in order, and nothing rotated away.
  diff <(printf "%s\n" "${texts[@]}") out.log
  [ ! -e out.log.1 ]
  # With '--' before TEXT, as the guide writes it.
  run dibs log out2.log -- --keep=2
  [ "$(cat out2.log)" = "--keep=2" ]
}

@test "a while-read loop of 'dibs log PATH \"\$line\"' writes every line once, in order, and reads no input itself" {
  {
    for i in $(seq 1 30); do
      echo "plain line $i"
      case $((i % 6)) in
        0) echo "--help" ;;
        1) echo "--keep=2" ;;
        2) echo "--timeout=1s" ;;
        3) echo "--rotate-size=1" ;;
        4) echo "--sync=record" ;;
        5) echo "--" ;;
      esac
    done
  } > input
  while IFS= read -r line; do
    dibs log out.log "$line"
  done < input
  cmp input out.log
  [ "$(wc -l < out.log)" -eq 60 ]
  [ ! -e out.log.1 ]
}
