// dibs/detail/sys.hpp: this platform's small system helpers
// (detail/posix/sys.hpp or detail/win32/sys.hpp): path_error, path_text,
// file_mode, current_pid.
#pragma once

#ifdef _WIN32
#include <dibs/detail/win32/sys.hpp>
#else
#include <dibs/detail/posix/sys.hpp>
#endif
