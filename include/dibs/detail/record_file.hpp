// dibs/detail/record_file.hpp: this platform's side of file_store: its file
// operations, directory listing and record files
// (detail/posix/{file_ops,directory,record_file}.hpp or their twins in
// detail/win32/).
#pragma once

#ifdef _WIN32
#include <dibs/detail/win32/directory.hpp>
#include <dibs/detail/win32/file_ops.hpp>
#include <dibs/detail/win32/record_file.hpp>
#else
#include <dibs/detail/posix/directory.hpp>
#include <dibs/detail/posix/file_ops.hpp>
#include <dibs/detail/posix/record_file.hpp>
#endif
