// dibs/detail/file_store/queue_view.hpp: file_store's queue view, a
// directory `.dibs-claims/` beside the records with one empty file (an
// entry) per claim record that a queue must find, named after the record's
// file, so that take_claimable and processing_keys list the few items they
// may want instead of reading every record (completed items have none):
//
//   .dibs-claims/format                      written by a full scan: the view is whole
//   .dibs-claims/scanned                     its time: when the last full scan ended
//   .dibs-claims/scan.lock                   one full scan at a time (a kernel lock)
//   .dibs-claims/ready/<priority>/<record>   offered or released, no not_before
//   .dibs-claims/scheduled/<not_before>.<priority>.<record>
//                                            offered or released with a not_before
//   .dibs-claims/processing/<record>         a processing claim (for the sweep)
//
// Where a record's entry goes is decided by the record alone (place_of), so
// a writer that replaces a record knows the entry of the old one exactly.
// The entries are a view, never the truth: a claim is taken only by the
// record's compare-and-set, after reading the record under its lock. An
// entry too many is harmless (whoever reaches it through the view reads the
// record and removes the entry); an entry missing is what the writers'
// order prevents (file_store.hpp says how) and the full scan repairs.
// Separate because the names and places are a format other processes (and
// other versions of dibs) rely on, as the record files' names are.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <dibs/detail/claim_record.hpp>
#include <dibs/detail/file_store/key_names.hpp>
#include <dibs/detail/record_file.hpp>
#include <dibs/detail/sys.hpp>
#include <dibs/error.hpp>

namespace dibs::detail::queue_view {

inline constexpr std::string_view dir_name = ".dibs-claims";
inline constexpr std::string_view format_name = "format";
inline constexpr std::string_view format_text = "dibs-claims 1\n";
inline constexpr std::string_view scanned_name = "scanned";
inline constexpr std::string_view lock_name = "scan.lock";
inline constexpr std::string_view ready_name = "ready";
inline constexpr std::string_view scheduled_name = "scheduled";
inline constexpr std::string_view processing_name = "processing";

enum class where { none, ready, scheduled, processing };

/// Where a record's entry is: the kind, and for a waiting item its priority
/// and not_before (ms since the epoch).
struct place {
  where kind = where::none;
  std::int64_t priority = 0;
  std::int64_t not_before = 0;
  friend bool operator==(const place&, const place&) = default;
};

/// Returns: the name of a scheduled entry of the record file `record`.
inline std::string scheduled_entry(std::int64_t not_before, std::int64_t priority, std::string_view record) {
  std::string s = std::to_string(not_before);
  s += '.';
  s += std::to_string(priority);
  s += '.';
  s += record;
  return s;
}

/// Returns: where the entry of the record file `record` holding `value`
/// (live or erased) goes. Only claim records (parse_head) have one. A
/// scheduled item whose entry name would be longer than a file name may be
/// (a record name near 255 bytes) is put with the ready ones instead: the
/// claims that reach it read its record, see its time has not come and
/// leave it there (it is its place), which costs one read per listing.
inline place place_of(bool live, std::string_view value, std::string_view record) {
  if (!live) return {};
  const auto h = claim_record::parse_head(value);
  if (!h) return {};
  if (h->state == claim_state::processing) return {where::processing};
  if (!h->waiting()) return {};
  if (h->not_before_ms && scheduled_entry(*h->not_before_ms, h->priority, record).size() <= record_name_max)
    return {where::scheduled, h->priority, *h->not_before_ms};
  return {where::ready, h->priority};
}

/// Returns: the path of the entry at `p` of the record file `record` in
/// the view `view` (.../.dibs-claims); empty for where::none.
inline std::filesystem::path entry_path(const std::filesystem::path& view, const place& p, std::string_view record) {
  switch (p.kind) {
    case where::none: return {};
    case where::ready: return child_path(child_path(view / ready_name, std::to_string(p.priority)), record);
    case where::scheduled: return child_path(view / scheduled_name, scheduled_entry(p.not_before, p.priority, record));
    case where::processing: return child_path(view / processing_name, record);
  }
  return {};
}

/// Parses a scheduled entry's name. Returns: false if it is not one.
inline bool parse_scheduled(std::string_view name, std::int64_t& not_before, std::int64_t& priority,
                            std::string_view& record) {
  const auto d1 = name.find('.');
  if (d1 == std::string_view::npos) return false;
  const auto d2 = name.find('.', d1 + 1);
  if (d2 == std::string_view::npos || d2 + 1 >= name.size()) return false;
  const auto num = [](std::string_view s, std::int64_t& out) {
    return !s.empty() && std::from_chars(s.data(), s.data() + s.size(), out).ptr == s.data() + s.size();
  };
  if (!num(name.substr(0, d1), not_before) || !num(name.substr(d1 + 1, d2 - d1 - 1), priority)) return false;
  record = name.substr(d2 + 1);
  return true;
}

/// Returns: the permissions of the view's directories for records made
/// with `mode`: searchable by whoever may read the records.
inline std::filesystem::perms directory_perms(file_mode mode) {
  auto m = static_cast<unsigned>(mode) & 0777u;
  m |= (m & 0444u) >> 2;  // x where r
  return static_cast<std::filesystem::perms>(m);
}

/// Effects: makes the directory `dir` and those above it up to the view,
/// with `mode`'s permissions. Throws: std::system_error naming it.
inline void make_directories(const std::filesystem::path& dir, file_mode mode) {
  std::error_code ec;
  if (std::filesystem::create_directories(dir, ec)) {
    std::filesystem::permissions(dir, directory_perms(mode), ec);
    ec.clear();  // on a filesystem without permissions the directory is usable as made
  }
  if (ec)
    throw std::system_error(ec, fmt::format("dibs::file_store: cannot make the queue view's directory '{}' (is the "
                                            "store's directory writable by this user?)",
                                            path_text(dir)));
}

/// Effects: makes the entry `path` (and its directory) if it is missing.
/// A directory removed meanwhile (a claim removes an emptied priority's
/// directory) is made again. Throws: std::system_error naming the entry.
inline void add_entry(const std::filesystem::path& path, file_mode mode) {
  for (int i = 0;; ++i) {
    const auto e = create_empty_file(path, mode);
    if (e == 0) return;
    if (!file_missing(e) || i == 100)
      throw path_error(e, "dibs::file_store: cannot make the queue view's entry", path);
    make_directories(path.parent_path(), mode);
  }
}

/// Effects: removes the entry `path` if it is there. Throws: std::system_error
/// naming it if it cannot be removed (a missing one is no error).
inline void remove_entry(const std::filesystem::path& path) {
  if (path.empty()) return;
  const auto e = remove_file(path);
  if (e != 0 && !file_missing(e)) throw path_error(e, "dibs::file_store: cannot remove the queue view's entry", path);
}

inline bool exists(const std::filesystem::path& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

/// Returns: the names of the files in `dir` (none if it is missing).
inline std::vector<std::string> list(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  const auto e = for_each_entry(dir, [&](const directory_entry& d) {
    if (!d.is_directory && d.name != "." && d.name != "..") out.emplace_back(d.name);
  });
  if (e != 0 && !file_missing(e)) throw path_error(e, "dibs::file_store: cannot list the queue view's directory", dir);
  return out;
}

/// Returns: the priorities that have a directory under `ready`, highest first.
inline std::vector<std::int64_t> ready_priorities(const std::filesystem::path& ready) {
  std::vector<std::int64_t> out;
  const auto e = for_each_entry(ready, [&](const directory_entry& d) {
    std::int64_t p = 0;
    const auto n = d.name;
    if (!n.empty() && std::from_chars(n.data(), n.data() + n.size(), p).ptr == n.data() + n.size()) out.push_back(p);
  });
  if (e != 0 && !file_missing(e)) throw path_error(e, "dibs::file_store: cannot list the queue view's directory", ready);
  std::sort(out.begin(), out.end(), std::greater<>{});
  return out;
}

/// One entry a claim may try: the entry's path and the record file it names.
struct candidate {
  std::filesystem::path entry;
  std::string record;
};

/// What one process remembers of the view between claims, so that a claim
/// lists a directory of many entries only once per pass over it, not each
/// time: per priority (and prefix) the entries not tried yet, in random
/// order; the scheduled entries whose time had come, and when to list the
/// scheduled ones again. A stale name here costs one stat (the entry is
/// gone: another worker took it). Shared by the store's threads under a
/// mutex; a copy of a store, or a child made by fork(), starts afresh (its
/// own random order, so that workers do not try the same entries in step).
class cache {
public:
  cache() = default;
  cache(const cache&) {}
  cache& operator=(const cache&) { return *this; }
  cache(cache&&) noexcept {}
  cache& operator=(cache&&) noexcept { return *this; }

  std::mutex m;
  /// Effects: forgets everything if this process is not the one that filled it.
  void check_process() {
    const auto me = current_pid();
    if (me == pid_) return;
    ready.clear();
    due.clear();
    next_scheduled_list = {};
    pid_ = me;
    rng.seed(std::random_device{}() ^ static_cast<std::uint64_t>(me));
  }
  std::map<std::pair<std::string, std::int64_t>, std::vector<std::string>> ready;  // (prefix, priority): names
  std::vector<std::pair<std::int64_t, candidate>> due;                              // priority, entry; come
  std::chrono::steady_clock::time_point next_scheduled_list{};
  std::mt19937_64 rng{};

private:
  process_id pid_{};
};

}  // namespace dibs::detail::queue_view
