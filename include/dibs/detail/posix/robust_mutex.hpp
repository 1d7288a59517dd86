// dibs/detail/posix/robust_mutex.hpp: a robust, process-shared pthread mutex that
// lives in shared memory (a mapped file or a shared memory segment). If its
// holder dies, the kernel hands it to the next locker with EOWNERDEAD, which
// repairs what the dead holder left half-done and goes on. Also: futex
// sleep and wake-up on a 32-bit word in shared memory.
#pragma once

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <string>

#include <dibs/detail/posix/process.hpp>

#if defined(__SANITIZE_THREAD__)
#define DIBS_DETAIL_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DIBS_DETAIL_TSAN 1
#endif
#endif
#ifndef DIBS_DETAIL_TSAN
#define DIBS_DETAIL_TSAN 0
#endif

// (A mutex word written in an earlier boot may name a thread that no longer
// exists and will never be cleaned up: shared state records the boot that
// set it up, boot_id() of process.hpp, and is set up anew after a reboot.)
namespace dibs::detail {

struct robust_mutex {
  pthread_mutex_t m;

  /// Requires: nobody uses the mutex (it is new, or from an earlier boot).
  /// Returns: 0 or an errno value.
  int init() noexcept {
    pthread_mutexattr_t attr;
    ::pthread_mutexattr_init(&attr);
    ::pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    ::pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    const int rc = ::pthread_mutex_init(&m, &attr);
    ::pthread_mutexattr_destroy(&attr);
    return rc;
  }

  /// Effects: waits up to `timeout` for the mutex.
  /// Returns: 0 if taken; EOWNERDEAD if taken from a holder that died (already
  /// marked consistent: the caller repairs the state it protects before
  /// unlocking); ETIMEDOUT; or another errno value.
  int lock_for(std::chrono::nanoseconds timeout) noexcept {
    // ThreadSanitizer does not intercept pthread_mutex_clocklock (and would
    // then report every unlock as bad): under it, use timedlock, whose
    // deadline is on the realtime clock.
#if DIBS_DETAIL_TSAN
    constexpr clockid_t clock = CLOCK_REALTIME;
#else
    constexpr clockid_t clock = CLOCK_MONOTONIC;
#endif
    timespec deadline{};
    ::clock_gettime(clock, &deadline);
    const auto ns = timeout.count() < 0 ? 0 : timeout.count();
    deadline.tv_sec += static_cast<time_t>(ns / 1'000'000'000);
    deadline.tv_nsec += static_cast<long>(ns % 1'000'000'000);
    if (deadline.tv_nsec >= 1'000'000'000) {
      deadline.tv_sec += 1;
      deadline.tv_nsec -= 1'000'000'000;
    }
#if DIBS_DETAIL_TSAN
    const int rc = ::pthread_mutex_timedlock(&m, &deadline);
#else
    const int rc = ::pthread_mutex_clocklock(&m, clock, &deadline);
#endif
    // Consistent at once: the protected state carries its own undo record, so
    // a repair that fails is simply tried again by the next holder.
    if (rc == EOWNERDEAD) ::pthread_mutex_consistent(&m);
    return rc;
  }

  /// Returns: 0 if taken; EOWNERDEAD if taken from a holder that died
  /// (marked consistent, as by lock_for); EBUSY if someone holds it.
  int try_lock() noexcept {
    const int rc = ::pthread_mutex_trylock(&m);
    if (rc == EOWNERDEAD) ::pthread_mutex_consistent(&m);
    return rc;
  }

  void unlock() noexcept { ::pthread_mutex_unlock(&m); }
};

/// Effects: tells the processor this thread is spinning on a memory word.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

/// Effects: sleeps while `*word == expected`, at most `timeout`, until
/// futex_wake on the same word (in any process that maps it: a shared futex).
/// Returns early, spuriously too: the caller re-checks the word.
inline void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected,
                       std::chrono::nanoseconds timeout) noexcept {
  const auto ns = timeout.count() < 0 ? 0 : timeout.count();
  timespec rel{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT, expected, &rel, nullptr, 0);
}

/// Effects: wakes up to `n` processes sleeping in futex_wait on `word`.
inline void futex_wake(std::atomic<std::uint32_t>& word, int n = 1) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE, n, nullptr, nullptr, 0);
}

}  // namespace dibs::detail
