// dibs/detail/process.hpp: this platform's answers about processes, for the
// proof rule of detail/owner.hpp (detail/posix/process.hpp or
// detail/win32/process.hpp): host_name, boot_id, own_process,
// own_pids_readable, process_start, pid_absent, process_gone.
#pragma once

#ifdef _WIN32
#include <dibs/detail/win32/process.hpp>
#else
#include <dibs/detail/posix/process.hpp>
#endif
