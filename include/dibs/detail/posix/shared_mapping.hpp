// dibs/detail/posix/shared_mapping.hpp: a file mapped into memory that every
// process which maps it shares (shared_log's lock file), on POSIX: its
// blocks allocated first, mapped, written back, unmapped. Separate so that
// a port to another system gives these names a body of its own
// (detail/win32/: CreateFileMapping).
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>

namespace dibs::detail {

/// Effects: allocates the blocks of the file's first `size` bytes (growing
/// it to `size` if shorter), so that a page of it touched later through a
/// mapping cannot fail for want of space (a sparse page that cannot be
/// allocated kills the process touching it with SIGBUS). Returns: 0 or errno.
inline int allocate_file(int fd, std::size_t size) noexcept {
  return ::posix_fallocate(fd, 0, static_cast<off_t>(size));
}

/// Effects: maps the first `size` bytes of the file, readable and writable,
/// shared with every process that maps it. Returns: the address, or nullptr
/// with errno set.
inline void* map_shared(int fd, std::size_t size) noexcept {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

/// Effects: writes the mapped bytes back to the file and waits for it.
inline void flush_shared(void* p, std::size_t size) noexcept { ::msync(p, size, MS_SYNC); }

/// Effects: unmaps what map_shared mapped.
inline void unmap_shared(void* p, std::size_t size) noexcept { ::munmap(p, size); }

}  // namespace dibs::detail
