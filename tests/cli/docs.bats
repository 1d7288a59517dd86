#!/usr/bin/env bats
# The man page dibs(1) and the bash and zsh completions are made from the
# command's own --help (cmake/dibs-docs.cmake) at each build: they are what
# the dibs under test says now, the page shows every subcommand's help, and
# the completions offer what --help lists.
load helpers

docs_dir() { echo "$(dirname "$(command -v dibs)")/docs"; }

@test "dibs(1) and the completions are those of the dibs built: made again from its --help, they are the same" {
  built=$(docs_dir)
  [ -f "$built/dibs.1" ] && [ -f "$built/dibs.bash" ] && [ -f "$built/_dibs" ]
  version=$(dibs --version | sed 's/^dibs //')
  docdir=$(sed -n '/^\.SH FILES/,/^\.SH/{/^\.I /s/^\.I //p}' "$built/dibs.1")
  cmake -DDIBS="$(command -v dibs)" -DVERSION="$version" -DDOCDIR="$docdir" -DOUT_DIR="$PWD" \
        -P "$BATS_TEST_DIRNAME/../../cmake/dibs-docs.cmake"
  cmp dibs.1 "$built/dibs.1"
  cmp dibs.bash "$built/dibs.bash"
  cmp _dibs "$built/_dibs"
}

@test "the man page has each subcommand's --help, every option of it, and where the guides are" {
  page=$(docs_dir)/dibs.1
  for sub in lock log claim offer work retry once status; do
    grep -q "^\.SH DIBS ${sub^^}\$" "$page"
    # Every long option the subcommand's help lists is in the page.
    for opt in $(dibs "$sub" --help | grep -o -- '--[a-z][-a-z]*' | sort -u); do
      grep -q -- "$opt" "$page" || { echo "dibs $sub: $opt missing from the page" >&3; false; }
    done
  done
  grep -q '^\.SH FILES' "$page"
  grep -q 'guide-shell.md' "$page"
  # --help says where the same guides are: the page's FILES names that path.
  docdir=$(sed -n '/^\.SH FILES/,/^\.SH/{/^\.I /s/^\.I //p}' "$page")
  dibs --help | tr '\n' ' ' | grep -q -- "'man dibs', and the guides in $docdir"
  if command -v man >/dev/null; then
    run man -l "$page"
    [ "$status" -eq 0 ]
    [[ "$output" == *"DIBS(1)"* ]]
    [[ "$output" == *"Usage: dibs lock [OPTIONS] PATH"* ]]
  fi
}

@test "bash completion: the subcommands first, then the subcommand's own options, else files" {
  . "$(docs_dir)/dibs.bash"
  COMP_WORDS=(dibs o); COMP_CWORD=1; _dibs
  [[ " ${COMPREPLY[*]} " == *" offer "* ]] && [[ " ${COMPREPLY[*]} " == *" once "* ]]
  [[ " ${COMPREPLY[*]} " != *" lock "* ]]
  COMP_WORDS=(dibs lock --ke); COMP_CWORD=2; _dibs
  [ "${COMPREPLY[*]}" = "--kernel" ]
  COMP_WORDS=(dibs once --ev); COMP_CWORD=2; _dibs
  [ "${COMPREPLY[*]}" = "--every" ]
  COMP_WORDS=(dibs lock --ev); COMP_CWORD=2; _dibs
  [ "${#COMPREPLY[@]}" -eq 0 ]
  touch app.lock
  COMP_WORDS=(dibs lock app.l); COMP_CWORD=2; _dibs
  [ "${COMPREPLY[*]}" = "app.lock" ]
}
