// dibs/detail/shared_log/shared_state.hpp: the layout of shared_log's lock
// file, which every writer of a log maps: the robust mutex, the queue of
// records (one slot each) waiting to be written, where the batch being
// written began (for the repair after its writer died), and who holds the
// lock. Separate because it is a format shared by every process and every
// version of dibs on the host: its layout must not change by accident
// (the static_asserts below), whatever changes in the code that uses it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

#include <dibs/detail/posix/robust_mutex.hpp>

namespace dibs::detail {

inline constexpr std::size_t log_slot_count = 64;

// One queued record in the lock file. `word` is the slot's state (low 3
// bits), a flag (bit 3) set while its owner may be asleep on the word, and a
// ticket (the other bits) that changes with every claim, so that a
// compare-and-set meant for one use of the slot cannot hit the next.
struct alignas(64) log_slot {
  enum : std::uint32_t {
    free = 0,     // nobody's
    filling = 1,  // its owner is copying its record in
    ready = 2,    // waiting to be written
    taken = 3,    // the lock holder is writing it
    done = 4,     // in the file (error != 0: but its fdatasync failed)
    failed = 5,   // not in the file, not in part either; error and failure say why
  };
  static constexpr std::uint32_t state_mask = 7, waiting = 8, ticket_unit = 16;

  std::atomic<std::uint32_t> word;
  std::uint32_t size;                // bytes of data, newline included
  std::atomic<std::int32_t> pid;     // the owner
  std::int32_t error;                // errno of a failure
  std::atomic<std::uint64_t> start;  // the owner's start time (with pid, its identity)
  std::atomic<std::uint64_t> pid_ns; // the owner's time namespace << 32 | its pid namespace
  std::uint32_t sync;                // 1: fdatasync before marking it done
  std::uint32_t failure;             // which step failed (log_failure)
  // The ticket of the claim that pid, start and pid_ns describe: stored after
  // them, so an owner is judged only by what its own claim wrote.
  std::atomic<std::uint32_t> owner_ticket;
  std::uint32_t reserved;
  char data[1024 - 48];
};
static_assert(sizeof(log_slot) == 1024);

// The parts of a slot's word.
constexpr std::uint32_t slot_state(std::uint32_t w) noexcept { return w & log_slot::state_mask; }
constexpr std::uint32_t slot_ticket(std::uint32_t w) noexcept { return w & ~(log_slot::state_mask | log_slot::waiting); }

// A slot's pid_ns field holds both namespaces its owner is judged in: the
// time namespace's inode above the PID namespace's (each is 32 bits). A
// slot of an older dibs holds the PID namespace alone, so its time
// namespace reads as none, which matches only a kernel without time
// namespaces: elsewhere its start time is not compared, and only a pid
// that no longer exists frees it (safe: such a slot is kept, never taken).
constexpr std::uint64_t pack_namespaces(std::uint32_t pid_ns, std::uint32_t time_ns) noexcept {
  return std::uint64_t{time_ns} << 32 | pid_ns;
}

// What a failed record's writer reports.
enum class log_failure : std::uint32_t { none, write, sync, reopen, seek };

// The outcome of one record of a batch: the batch's failure, else its
// fdatasync's if the record asked for one, else success.
inline std::pair<int, log_failure> log_outcome(int error, log_failure failure, int sync_error,
                                               bool wants_sync) noexcept {
  if (error) return {error, failure};
  if (wants_sync && sync_error) return {sync_error, log_failure::sync};
  return {0, log_failure::none};
}

// What append() says of a failure, before the log's path.
inline const char* describe_log_failure(log_failure f) noexcept {
  switch (f) {
    case log_failure::sync: return "record appended, but fdatasync failed, for log";
    case log_failure::reopen: return "cannot open the log file again after a rotation, for log";
    case log_failure::seek: return "cannot find the end of log";
    default: return "cannot append to log";
  }
}

// The lock file `.<log's name>.dibs-lock`, shared by every writer through mmap.
struct log_shared_state {
  static constexpr char magic_value[8] = {'d', 'i', 'b', 's', 'l', 'o', 'g', '3'};
  char magic[8];
  char boot_id[40];             // the boot that set the mutex up; after a reboot it is set up anew
  robust_mutex mutex;
  std::uint64_t generation;     // bumped by every rotation
  std::uint64_t unused;         // dibs 0.1.0: the n of the next `<log>.<n>` (rotated files counted up)
  std::int64_t pending_start;   // where the batch being written began; -1: none
  std::int64_t pending_len;     // and its length
  std::uint64_t pending_dev;    // and the file it went to
  std::uint64_t pending_ino;
  std::uint32_t needs_repair;   // a holder died; cleared when its leftovers are dealt with
  std::int64_t file_end;        // where the last batch ended; -1: unknown
  std::int64_t file_end_ns;     // when that batch began (CLOCK_MONOTONIC)
  // Who holds the mutex, for messages only: written by each holder after
  // taking it, cleared before it lets go, read without the lock by a writer
  // that timed out (in bytes that were padding in dibs 0.1, which ignores them).
  std::atomic<std::int32_t> holder_pid;         // 0: none recorded
  std::atomic<std::uint32_t> holder_pid_ns;     // its PID namespace (inode)
  std::atomic<std::int64_t> holder_since_ms;    // when it took the lock (unix ms)
  std::atomic<std::uint64_t> holder_start;      // its start time (ticks since boot)
  // Bit i: slot i may be ready (set by its owner after marking it ready,
  // cleared by the holder that takes the ready slots). A hint, so that a
  // holder reads one word rather than every slot; the slot's word decides.
  alignas(64) std::atomic<std::uint64_t> ready_slots;
  alignas(4096) log_slot slots[log_slot_count];
};

static_assert(offsetof(log_shared_state, ready_slots) == 192, "the shared state's layout is that of every dibs");

}  // namespace dibs::detail
