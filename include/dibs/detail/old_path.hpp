// dibs/detail/old_path.hpp: for a header kept at its path of dibs 0.1,
// which forwards to its new path for one release (0.2). Where #pragma
// message is a note that no warning option turns into an error (GCC, MSVC),
// DIBS_OLD_PATH_NOTE is 1 and each such header says, once per compile,
// which path to include instead. With clang, #pragma message is a warning,
// which -Werror makes an error, and dibs never breaks a build on a warning:
// there the README and the header's first line say it, and the compiler
// does not. Define DIBS_NO_OLD_PATH_NOTES to silence the notes.
#pragma once

#if !defined(DIBS_NO_OLD_PATH_NOTES) && ((defined(__GNUC__) && !defined(__clang__)) || defined(_MSC_VER))
#define DIBS_OLD_PATH_NOTE 1
#else
#define DIBS_OLD_PATH_NOTE 0
#endif
