// dibs/detail/process_identity.hpp: what a record says of the process that
// wrote it, enough to judge by its pid on this machine (detail/owner.hpp
// holds the rule, detail/<platform>/process.hpp the system calls).
#pragma once

#include <cstdint>

namespace dibs::detail {

/// Enough of a process's identity to judge by its pid, on this machine.
struct process_identity {
  long pid = 0;
  // Linux: clock ticks after boot (/proc/<pid>/stat field 22); Windows: the
  // creation time (GetProcessTimes, 100 ns since 1601). 0: unknown.
  std::uint64_t start = 0;
  std::uint32_t pid_ns = 0;   // Linux: inode of /proc/self/ns/pid; 0: unknown. Windows: 0 (none)
  std::uint32_t time_ns = 0;  // Linux: inode of /proc/self/ns/time; 0: none or unknown. Windows: 0 (none)
  friend bool operator==(const process_identity&, const process_identity&) = default;
};

}  // namespace dibs::detail
