// dibs/detail/file_store/version_floor.hpp: the version floor of record
// files, kept in a file beside them that outlives a record's own file.
//
// A record's versions are fencing tokens: they must grow for a key as long
// as it is used, also when a person removes its file (`rm L` while a lock
// is held; a spool cleaned by hand). The record's own file cannot say what
// its versions were once it is gone, so a second file does, a record (the
// same checksummed text, written in place in two slots) whose value says
// "floor N": no version a record it covers has had, or will have without
// raising the floor first, is above N.
//   - A record made from nothing (no file) takes N + 1 and raises the floor
//     to the end of its window (windows of floor_window versions), while it
//     holds the floor's flock across the link() that puts the record in
//     place: two makers of one key take their turns, so the one that links
//     later always has the larger version.
//   - A write that takes a record's version into its next window raises
//     the floor first (under the record's flock, then the floor's: records
//     are always locked before floors). A record renewed every few seconds
//     does that about once a month; a record rewritten a million times a
//     second, every 65 ms.
// So after a removal the next record starts above every version the removed
// one had, whoever removed it. Which records a floor covers is the store's
// choice: one floor per directory (`.dibs-floor`, a store's own directory:
// one more flock and pwrite per record made, on a descriptor kept open),
// or one per record file (`.dibs-floor.<record file name>`, for lock files,
// which live in directories shared with anything, where another user may
// not be able to write a directory-wide file). The floor file is made with
// the records' mode (whoever may write the records may write their floor)
// and never removed by dibs; remove it only with its records, when no
// process uses them. A record made by a dibs before 0.4 has no floor until
// its first window ends: remove such a record's file only when it is free
// (docs/file-locks.md).
#pragma once

#include <charconv>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include <dibs/detail/digits.hpp>
#include <dibs/detail/file_store/atomic_write.hpp>
#include <dibs/detail/file_store/kept_record.hpp>
#include <dibs/detail/file_store/key_names.hpp>
#include <dibs/detail/file_store/record_format.hpp>
#include <dibs/detail/file_store/record_io.hpp>
#include <dibs/detail/file_store/two_slots.hpp>
#include <dibs/detail/record_file.hpp>
#include <dibs/detail/sys.hpp>
#include <dibs/error.hpp>
#include <dibs/store.hpp>

namespace dibs::detail {

inline constexpr std::string_view floor_prefix = ".dibs-floor.";
inline constexpr std::string_view directory_floor_name = ".dibs-floor";
// Versions a record may reach before its floor must be raised again.
inline constexpr dibs::version floor_window = 65536;

// Returns: the end of the window `v` is in (a multiple of floor_window).
constexpr dibs::version floor_window_end(dibs::version v) noexcept {
  return (v + floor_window - 1) / floor_window * floor_window;
}

// Returns: the name of the floor file of the record file `record_name`,
// cut (with record_cut_mark and a hash of the whole name) where it would be
// longer than a file name may be.
inline std::string floor_name_of(std::string_view record_name) {
  std::string name = std::string(floor_prefix) + std::string(record_name);
  if (name.size() <= record_name_max) return name;
  const std::size_t keep = record_name_max - floor_prefix.size() - record_cut_mark.size() - 16;
  return fmt::format("{}{}{}{}", floor_prefix, record_name.substr(0, keep), record_cut_mark,
                     hex_digits(name_hash(record_name), 16));
}

// A floor, held under its exclusive flock from construction to destruction.
class version_floor {
public:
  /// Effects: opens the floor file `name` in `dir` (making it, at 0, if
  /// there is none; through the descriptor `kept` holds, if it holds one
  /// of it) and takes its flock.
  /// Throws: std::system_error naming the floor's path (errc::timed_out at
  /// `t`; errc::corrupt_record for a damaged floor).
  version_floor(const std::filesystem::path& dir, std::string name, file_mode mode, bool sync, dibs::time_limit t,
                kept_record* kept = nullptr)
      : dir_(dir), name_(std::move(name)), path_(child_path(dir, name_)), sync_(sync), kept_(kept) {
    if (kept_) fd_ = kept_->take(name_);
    for (;;) {
      if (!fd_) {
        int e = fd_.open(path_, name_, true);
        if (e != 0 && file_missing(e)) {
          make(mode);
          continue;
        }
        if (e != 0) throw record_open_error(e, path_);
        fd_.check_regular(path_);
      }
      lock_record(fd_.get(), file_lock_kind::exclusive, path_, t);
      bool same = false;
      const int e = fd_.names_this(path_, same);
      if (e != 0 && !file_missing(e)) throw path_error(e, "dibs::file_store: cannot stat version floor", path_);
      if (e != 0 || !same) {  // removed or replaced (while we waited, or since it was kept): again, by the path
        fd_.close();
        continue;
      }
      auto cur = load_record(fd_.get(), path_);
      if (!cur) continue;
      cur_ = std::move(*cur);
      value_ = parse(cur_.value);
      return;
    }
  }
  version_floor(const version_floor&) = delete;
  version_floor& operator=(const version_floor&) = delete;
  /// Effects: lets the floor go (its flock), keeping the descriptor in
  /// `kept` for the next floor of the same file.
  ~version_floor() {
    if (kept_ && fd_ && fd_.unlock()) kept_->keep(std::move(fd_));
  }

  /// Returns: the floor: no version of the record is above it.
  dibs::version value() const noexcept { return value_; }

  /// Effects: raises the floor to the end of the window of `v`, if it is
  /// below that (flushed first with `sync`).
  void cover(dibs::version v) {
    const dibs::version to = floor_window_end(v);
    if (to <= value_) return;
    if (reread_) cur_ = decode_record_file(path_, slurp_record(fd_.get(), path_), false);  // a second cover in one hold
    const std::string rec = encode_record(std::max(cur_.version + 1, cur_.next_after_torn), true, text(to), {});
    write_other_slot(fd_.get(), cur_, rec, path_);
    if (sync_)
      if (const int e = sync_data(fd_.get())) throw path_error(e, "dibs::file_store: cannot flush version floor", path_);
    if constexpr (!records_always_in_place) mark_stale(fd_.get(), cur_);
    reread_ = true;
    value_ = to;
  }

private:
  static std::string text(dibs::version floor) {
    return fmt::format("floor {}\n(the version floor of the record file beside it: a record made again after its "
                       "file was removed starts above this; dibs::file_store)\n",
                       floor);
  }

  dibs::version parse(std::string_view value) const {
    dibs::version v = 0;
    if (value.starts_with("floor ")) {
      const char* first = value.data() + 6;
      const char* last = value.data() + value.size();
      const auto [end, ec] = std::from_chars(first, last, v);
      if (ec == std::errc{} && end != first && (end == last || *end == '\n')) return v;
    }
    corrupt_record(path_, "a version floor without its 'floor N' line");
  }

  // Makes the floor file at 0, whole, unless one appeared meanwhile.
  void make(file_mode mode) {
    const auto tmp = write_temporary(dir_, mode, sync_, encode_record(1, true, text(0), {}));
    const int e = link_new_record(tmp, path_);
    (void)remove_file(tmp);
    if (e != 0 && !file_exists(e)) throw path_error(e, "dibs::file_store: cannot create version floor", path_);
    if (e == 0) sync_record_directory(dir_, sync_);
  }

  std::filesystem::path dir_;
  std::string name_;
  std::filesystem::path path_;
  bool sync_;
  kept_record* kept_;
  record_handle fd_;
  stored_record cur_;
  dibs::version value_ = 0;
  bool reread_ = false;  // cur_ is no longer what the file holds
};

}  // namespace dibs::detail
