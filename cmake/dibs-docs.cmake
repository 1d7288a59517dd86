# cmake -P: the dibs command's man page and shell completions, made from
# its own --help texts (the program's, then each subcommand's), so that the
# page, the completions and --help cannot disagree. Run after each build of
# the command (tools/CMakeLists.txt); installed with it.
#
# In:  DIBS (the built program), VERSION, DOCDIR (where the docs are
#      installed, named in the page), OUT_DIR.
# Out: OUT_DIR/dibs.1 (roff), OUT_DIR/dibs.bash (bash), OUT_DIR/_dibs (zsh).

function(dibs_help out)
  execute_process(COMMAND ${DIBS} ${ARGN} --help OUTPUT_VARIABLE text RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "dibs-docs: '${DIBS} ${ARGN} --help' failed (${rc}): ${err}")
  endif()
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

# roff: a backslash is \e; a line starting with . or ' would be a request.
function(dibs_roff out text)
  string(REPLACE "\\" "\\e" text "${text}")
  string(REGEX REPLACE "(^|\n)([.'])" "\\1\\\\&\\2" text "${text}")
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

dibs_help(top)
# The subcommands: the lines of the "Subcommands:" block, "  NAME  summary".
string(REGEX MATCH "Subcommands:\n(([ ]+[a-z]+[ ]+[^\n]*\n)+)" block "${top}")
string(REGEX MATCHALL "\n?  [a-z]+ " names "${CMAKE_MATCH_1}")
set(subcommands)
foreach(n IN LISTS names)
  string(STRIP "${n}" n)
  list(APPEND subcommands ${n})
endforeach()
if(NOT subcommands)
  message(FATAL_ERROR "dibs-docs: no subcommands in '${DIBS} --help'")
endif()

string(REGEX MATCH "^dibs: ([^\n]*)" _ "${top}")
set(summary "${CMAKE_MATCH_1}")
string(TIMESTAMP year "%Y")

# The man page: NAME, SYNOPSIS, then each --help verbatim (no fill, no
# adjustment, as printed on a terminal), and where the guides are.
dibs_roff(top_roff "${top}")
set(page ".TH DIBS 1 \"\" \"dibs ${VERSION}\" \"User Commands\"
.SH NAME
dibs \\- ${summary}
.SH SYNOPSIS
.nf
")
foreach(s IN LISTS subcommands)
  string(APPEND page "\\fBdibs ${s}\\fR [\\fIOPTIONS\\fR] ...\n")
endforeach()
string(APPEND page ".fi
.SH DESCRIPTION
The text of \\fBdibs \\-\\-help\\fR, then of each \\fBdibs\\fR \\fISUBCOMMAND\\fR \\fB\\-\\-help\\fR.
.PP
.nf
${top_roff}.fi
")
foreach(s IN LISTS subcommands)
  dibs_help(text ${s})
  dibs_roff(text "${text}")
  string(TOUPPER "${s}" upper)
  string(APPEND page ".SH DIBS ${upper}\n.nf\n${text}.fi\n")
  # The long options of this subcommand, for the completions.
  string(REGEX MATCHALL "(^|\n)  (-[A-Za-z],)*--[a-z][-a-z]*(,--[a-z][-a-z]*)*" lines "${text}")
  set(opts)
  foreach(l IN LISTS lines)
    string(REGEX MATCHALL "--[a-z][-a-z]*" longs "${l}")
    list(APPEND opts ${longs})
  endforeach()
  list(REMOVE_DUPLICATES opts)
  list(JOIN opts " " opts_${s})
endforeach()
string(APPEND page ".SH FILES
.TP
.I ${DOCDIR}
the guides: guide-shell.md (this command, with cron and flock(1) recipes),
guarantees.md (what holds and what does not), and the rest.
.SH SEE ALSO
.BR flock (1),
.BR lockfile (1),
.BR dotlockfile (1)
")
file(WRITE ${OUT_DIR}/dibs.1 "${page}")

# bash: the subcommands, then each subcommand's long options, else files.
list(JOIN subcommands " " all)
set(bash "# bash completion for dibs (made from its --help by cmake/dibs-docs.cmake)
_dibs() {
  local cur=\${COMP_WORDS[COMP_CWORD]} opts=
  if [ \"\$COMP_CWORD\" -eq 1 ]; then
    COMPREPLY=(\$(compgen -W '${all} --help --version' -- \"\$cur\" || true))
    return 0
  fi
  case \${COMP_WORDS[1]} in
")
foreach(s IN LISTS subcommands)
  string(APPEND bash "    ${s}) opts='${opts_${s}}' ;;\n")
endforeach()
string(APPEND bash "  esac
  if [[ \$cur == -* ]]; then
    COMPREPLY=(\$(compgen -W \"\$opts\" -- \"\$cur\" || true))
  else
    COMPREPLY=(\$(compgen -f -- \"\$cur\" || true))
  fi
  return 0
}
complete -o default -F _dibs dibs
")
file(WRITE ${OUT_DIR}/dibs.bash "${bash}")

# zsh: the same lists, through zsh's own completion functions.
set(zsh "#compdef dibs
# zsh completion for dibs (made from its --help by cmake/dibs-docs.cmake)
local -a subcommands
subcommands=(${all})
if (( CURRENT == 2 )); then
  _describe 'dibs subcommand' subcommands
  return
fi
local -a opts
case \$words[2] in
")
foreach(s IN LISTS subcommands)
  string(APPEND zsh "  ${s}) opts=(${opts_${s}}) ;;\n")
endforeach()
string(APPEND zsh "esac
if [[ \$PREFIX == -* ]]; then
  compadd -- \$opts
else
  _files
fi
")
file(WRITE ${OUT_DIR}/_dibs "${zsh}")
