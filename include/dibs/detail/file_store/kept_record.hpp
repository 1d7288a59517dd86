// dibs/detail/file_store/kept_record.hpp: the descriptor of a record file
// rewritten in place, kept open (without its flock) from one operation to
// the next on the same record, and the handle an operation holds the record
// through. A lock_file's lock and unlock each cost an open, an fstat and a
// close less (docs/benchmarks-history.md, "Fair handoff"): the file's identity is
// known from when it was opened, and the operation still checks under the
// flock, with one lstat, that the path names that file. Separate because
// whether a kept descriptor may be used (same record, same process, same
// file) is a rule of its own, which the compare-and-set relies on.
#pragma once

#include <mutex>
#include <string_view>
#include <utility>

#include <dibs/detail/record_file.hpp>
#include <dibs/detail/sys.hpp>

namespace dibs::detail {

// The one record descriptor a file_store keeps between operations (of the
// last record it rewrote in place). Shared by the store's threads: an
// operation takes it out and puts it back, so two never use it at once.
// Copying a store does not copy it.
class kept_record {
public:
  kept_record() = default;
  kept_record(const kept_record&) noexcept {}
  kept_record& operator=(const kept_record& o) noexcept {
    if (this != &o) drop();
    return *this;
  }
  kept_record(kept_record&& o) noexcept {
    std::lock_guard g{o.m_};
    h_ = std::move(o.h_);
    pid_ = std::exchange(o.pid_, 0);
  }
  kept_record& operator=(kept_record&& o) noexcept {
    if (this != &o) {
      record_handle h;
      process_id pid;
      {
        std::lock_guard g{o.m_};
        h = std::move(o.h_);
        pid = std::exchange(o.pid_, 0);
      }
      drop();
      std::lock_guard g{m_};
      h_ = std::move(h);
      pid_ = pid;
    }
    return *this;
  }
  ~kept_record() { drop(); }

  /// Returns: the kept descriptor if it is of the record file `name` and was
  /// opened by this process (in a child made by fork() it was closed at the
  /// fork, and its number may name another file now: forgotten, not
  /// closed); else an empty handle. Another record's descriptor is closed.
  record_handle take(std::string_view name) noexcept {
    record_handle h;
    {
      std::lock_guard g{m_};
      if (!h_) return h;
      if (pid_ != current_pid()) {
        h_.forget();
        return h;
      }
      h = std::move(h_);
    }
    if (h.name() != name) h.close();
    return h;
  }

  /// Requires: `h` is writable, holds no flock, and its path named it under
  /// the flock a moment ago. Effects: keeps it for the next operation
  /// (closing the one kept before, if another thread put one back meanwhile).
  void keep(record_handle&& h) noexcept {
    record_handle old;
    std::lock_guard g{m_};
    if (pid_ == current_pid()) old = std::move(h_);
    else h_.forget();
    h_ = std::move(h);
    pid_ = current_pid();
  }

private:
  void drop() noexcept {
    std::lock_guard g{m_};
    if (pid_ != current_pid()) h_.forget();
    h_.close();
    pid_ = 0;
  }

  std::mutex m_;
  record_handle h_;
  process_id pid_ = 0;
};

}  // namespace dibs::detail
