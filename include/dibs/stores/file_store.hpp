// dibs/stores/file_store.hpp: a dibs::shared_store of one file per key in a
// directory, shared by every process that opens the same directory.
//
//   dibs::file_store store{"/var/spool/app/claims"};
//   if (auto v = store.create("msg-1", "processing")) { ... }
//
// A record file `<dir>/<key>.rec` is text a person can read:
//
//   dibs-record 1
//   version 7
//   state live                  (or: erased)
//   size 10
//   crc32 5d0bd0a3
//
//   processing
//
// A key is any bytes (store.hpp). Its file is named by the key itself where
// a file name can be the key; the bytes it cannot hold or that would make
// names ambiguous are written %XX: '/', '%', control bytes, and the first '.'
// of ".", ".." and of keys starting ".dibs-" (dibs's own files). So the key
// `<abc/def+1@mail.example.com>` is in `<abc%2Fdef+1@mail.example.com>.rec`.
// A name longer than a file name may be (255 bytes) is cut, and ends in "%~"
// and a hash of the key (the escaping never writes "%~"). The record of an
// escaped or cut name holds its key too, on a line `key <escaped key>` after
// `size`, and is read only as the record of that key; a record without that
// line at such a name was written by dibs 0.1 (whose keys could not be
// escaped), for the key spelled like the name, and is reported, never
// misread; so is a record of dibs 0.1 for a key with '%' (its old name), so
// that an item done before an upgrade is never taken for absent.
//
// The crc32 covers the header lines above it and the value, so a torn or
// damaged file is reported (errc::corrupt_record, naming the file), never
// misread.
//
// How each operation is atomic, with no state that a SIGKILL can leave wedged:
//   - every record is written whole to a temporary file first, then put in
//     place by link() (create: fails if the key exists) or an atomic exchange
//     with the old record (replace, erase; rename() where the filesystem has
//     no RENAME_EXCHANGE): a reader sees the old record or the new one, never
//     half of one;
//   - replace and erase are compare-and-set under a kernel flock on the record
//     file, which the kernel releases if the holder dies; after taking it the
//     holder checks that the path still names the same inode, so a writer that
//     waited on a file since replaced starts again;
//   - erase leaves an "erased" record that keeps the version, so a later
//     create continues from it: versions never go back (they are fencing
//     tokens); and a record made after its file was removed (by a person:
//     `rm L` while a lock is held) starts above every version the removed
//     file had, by the version floor beside it: `.dibs-floor` for the
//     directory, or `.dibs-floor.<record file name>` with key_is_file_name
//     (detail/file_store/version_floor.hpp);
//   - temporary files (`.dibs-tmp.<boot>.<pid ns>.<time ns>.<pid>.<start>.<random>`)
//     of processes that are provably gone, by the rule of detail/owner.hpp,
//     are removed when a store is opened; no other file is ever removed.
// A record's path is never followed through a symbolic link (a link in a
// shared directory could point anywhere) and must be a regular file: anything
// else there is reported, naming the path. Descriptors that hold a record's
// flock are closed in a child made by fork(), so a forked child never keeps
// a lock its parent took for a moment.
// A timed operation (the overloads taking a dibs::time_limit, which the
// policies use for try_lock, try_lock_for and try_claim) waits for a record's
// flock only until its deadline, then throws errc::timed_out: a process
// stopped (SIGSTOP, a debugger) while it holds one record's flock delays
// those calls by at most their time, and other keys not at all.
// With file_store_options::in_place (dibs::lock_file's choice), a small
// record is instead rewritten inside its file, under the same flock: the file
// has two slots of 2 KiB in its first page, the new record goes into the slot
// that does not hold the current one, and a reader takes the whole record
// with the higher version. A writer killed mid-write can only damage the slot
// that was not current, so the file always holds one whole, current record.
// Once the new record is whole (its pwrite has returned), the old slot is
// overwritten with a line that says it is an old copy and where the current
// record is, so that `cat` shows only the current record (a free lock as
// `state erased`); readers skip such a slot. A writer killed while it marks
// leaves the new record whole and the old slot torn, which is a slot that
// was not current either. The descriptor of the last record rewritten in
// place stays open (without its flock) for the next operation on it
// (detail/file_store/kept_record.hpp): no open, fstat and close per
// operation; the lstat under the flock still checks that the path names it.
// One host or many: flock, link and rename are atomic on local filesystems;
// over NFS only link is (use a server-backed store there).
// Waiters of a lease_mutex on a key queue in `.dibs-queue.<record file name>`
// beside the record (open_waiter_queue; detail/posix/waiter_queue.hpp): a
// page every waiter of this host maps, made at a lease_mutex's first lock,
// never removed. It orders the tries only; the records are as above.
//
// The queue view (marker_claim's claim_next through take_claimable and
// processing_keys; detail/file_store/queue_view.hpp): `.dibs-claims/` beside
// the records holds one empty file per claim record that is offered or
// released (under ready/<priority>/, or scheduled/ named by its not_before)
// or processing, named after the record's file. Every create, replace and
// erase keeps it in step while it holds the record's lock: the new
// record's entry is made before the record can be seen, the old one's
// removed after it, still under the lock (a record put in place as a new
// file is locked before it is), so an entry is never missing for a record
// once its write has returned. A claim lists the priorities, then the
// entries of the highest (once per pass: this process keeps the listing,
// in random order), and takes an item by the record's compare-and-set
// after reading it under its lock: an entry too many (of a writer killed
// between its record and the entry's removal) is skipped and removed, and
// nothing is ever taken twice. An entry whose record is missing is removed
// only under the version floor's flock, which a creator holds from making
// the entry to linking the record: never the entry of a record on its way.
// So a claim reads no completed record, and lists 50,000 waiting entries
// once per 50,000 claims, not each time.
// Scheduled entries are listed again when the earliest one known comes,
// and at least every second.
// The view is rebuilt from the records by one scan (under the kernel lock
// `.dibs-claims/scan.lock`, by one process; the others go on) when its
// `format` file is missing: never made (records written before this
// version), or the directory removed by a person. A dibs without the view
// (or a person, or a restore) writing to the same directory does not keep
// it: what it offers or gives back has no entry and is found by the full
// check of the view against every record that runs at most every
// file_store_options::queue_rescan (5 minutes; `scanned` holds the time of
// the last one), or at once by rebuild_queue_view(); what it takes or
// completes leaves an entry too many, which costs a read. Such an item
// waits, then, but is never lost and never taken twice. With `sync`, the
// entries are not flushed: after a crash of the machine the periodic check
// puts a lost one back.
//
// The parts, in include/dibs/detail/file_store/: record_format.hpp (the
// record's text and checksum), two_slots.hpp (records rewritten in place),
// record_io.hpp (opening, locking, reading a record file), atomic_write.hpp
// (temporary file, then link or exchange; dead temporaries removed),
// kept_record.hpp (the descriptor kept between operations), key_names.hpp (key to file name), old_names.hpp (records of dibs 0.1),
// queue_view.hpp (the queue view's places and names);
// system calls in include/dibs/detail/posix/ (record_file.hpp, file_ops.hpp,
// directory.hpp, ...) and their twins in include/dibs/detail/win32/.
//
// On Windows (docs/windows.md) every record is rewritten in place, in slots
// of 16 KiB (values up to 12 KiB), under a LockFileEx lock on one byte past
// the data: Windows cannot rename a file over one that others have open. A
// record is created by CreateHardLinkW from a temporary; upper-case letters,
// bytes from 0x80, the characters Windows forbids and device names are
// escaped in file names, which Windows compares without case.
#pragma once



#include <algorithm>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <dibs/detail/claim_record.hpp>
#include <dibs/detail/file_store/atomic_write.hpp>
#include <dibs/detail/file_store/kept_record.hpp>
#include <dibs/detail/file_store/key_names.hpp>
#include <dibs/detail/file_store/old_names.hpp>
#include <dibs/detail/file_store/queue_view.hpp>
#include <dibs/detail/file_store/record_format.hpp>
#include <dibs/detail/file_store/record_io.hpp>
#include <dibs/detail/file_store/two_slots.hpp>
#include <dibs/detail/file_store/version_floor.hpp>
#include <dibs/detail/record_file.hpp>
#include <dibs/detail/sys.hpp>
#ifndef _WIN32
#include <dibs/detail/posix/file_watch.hpp>
#include <dibs/detail/posix/waiter_queue.hpp>
#endif
#include <dibs/error.hpp>
#include <dibs/file_mutex.hpp>
#include <dibs/store.hpp>

namespace dibs {

struct file_store_options {
  /// fsync each record and its directory before an operation returns, so a
  /// record survives a crash of the machine, not only of the process.
  bool sync = false;
  /// Permissions of the record files this store creates: exactly these bits,
  /// whatever the umask. Records shared by several users must be writable by
  /// all of them: 0664 with a shared group, or 0666 (in a sticky directory
  /// such as /tmp another user can only write a record in place, never
  /// replace it).
  detail::file_mode mode = 0644;
  /// Appended to the key's name to name its file.
  std::string suffix = ".rec";
  /// The key is the file's name itself, which must then be one: no '/' or
  /// NUL, not "." or "..", at most 255 bytes with the suffix (dibs::lock_file
  /// does this, with an empty suffix, so the lock file is exactly the path it
  /// was given). Otherwise any key is encoded into a file name (see path_of).
  bool key_is_file_name = false;
  /// Rewrite a record of up to 2 KiB inside its own file, under its flock,
  /// instead of writing a new file and exchanging it in (dibs::lock_file
  /// does: one pwrite instead of a temporary file, an exchange and an
  /// unlink). The file then has two
  /// slots, at offsets 0 and 2048, each a record padded with newlines; the
  /// new record goes into the slot that is not current, so a writer killed
  /// mid-write leaves the current record whole, and readers take the valid
  /// record with the higher version. Then the old slot is overwritten with a
  /// line saying it is stale and where the current record is, so `cat`
  /// shows one record. A reader that catches
  /// a slot half-copied reads again under a shared flock. Not used with
  /// `sync`, for a larger record, or where this user may not write the file
  /// itself: those go by a new file as without this option. In a sticky
  /// directory (such as /tmp) records are always written in place: only a
  /// file's owner may replace it there.
  bool in_place = false;
  /// An empty file at a record's path holds no record: the key reads as
  /// free, and a create writes its record into that file, under the file's
  /// flock, above the key's version floor. dibs::lock_file does: an empty
  /// file is what flock(1) and other kernel-lock tools leave behind, and
  /// while one of them holds its flock on the file, the create waits for it
  /// (a try reads it as busy). Otherwise an empty record file is reported as
  /// damaged (dibs never writes one).
  bool empty_is_free = false;
  /// How often the queue view (`.dibs-claims/`, see take_claimable) is
  /// checked against every record by a full scan, which finds the items a
  /// writer that does not keep the view (a dibs older than the view, a
  /// record written by hand) put in the queue, and the entries a crash of
  /// the machine lost: at most once per this time across all processes of
  /// the directory (one scans, the others go on), by the take_claimable
  /// that finds it due. duration::max(): never (only a missing view is
  /// rebuilt).
  std::chrono::seconds queue_rescan = std::chrono::minutes{5};
};

class file_store {
public:
  /// Effects: opens the store in an existing directory and removes temporary
  /// files left by processes that are gone.
  /// Throws: std::system_error naming the directory if it is missing, not a
  /// directory, or not writable by this user.
  explicit file_store(std::filesystem::path directory, file_store_options opts = {})
      : dir_(std::move(directory)), opts_(opts) {
    // In a sticky directory (/tmp) only a file's owner may replace it, so
    // records are rewritten in place there, which any user who may write
    // the file can do (file_store_options::mode).
    sticky_ = detail::check_record_directory(dir_);
    if (!opts_.key_is_file_name && !detail::key_names_for_windows) refuse_case_folding();
    detail::remove_dead_temporaries(dir_);
  }

  /// Returns: the live record of `key`, or nothing.
  /// Throws: std::system_error(errc::corrupt_record) naming the file if it is
  /// damaged or not a dibs record; errc::invalid_argument for a bad key.
  std::optional<record> read(std::string_view key) const { return read(key, dibs::time_limit::max()); }
  /// Effects, Returns, Throws: as read(key); errc::timed_out if the record
  /// is caught mid-write and its writer has not finished by `t`.
  std::optional<record> read(std::string_view key, dibs::time_limit t) const {
    const auto name = resolve(key, "dibs::file_store::read");
    const auto path = detail::child_path(dir_, name.name);
    auto r = detail::load_record(path, t, opts_.empty_is_free);
    if (r) check_key(*r, key, name, path);
    if (!r || !r->live) return std::nullopt;
    return record{std::move(r->value), r->version};
  }

  std::optional<dibs::version> create(std::string_view key, std::string_view value) {
    return create(key, value, dibs::time_limit::max());
  }
  /// Effects, Returns, Throws: as create(key, value); errc::timed_out if the
  /// record's flock is held by another process until `t`.
  std::optional<dibs::version> create(std::string_view key, std::string_view value, dibs::time_limit t) {
    const auto name = resolve(key, "dibs::file_store::create");
    check_value(key, value, name);
    const auto path = detail::child_path(dir_, name.name);
    for (;;) {
      // An erased record keeps the key's version: continue from it, under the
      // record's lock, without first writing a file that link() would refuse.
      const auto swapped = swap_if(key, name, [&](const stored& c) { return when(!c.live, value); }, true, t);
      if (swapped.outcome == swap_outcome::done) return swapped.version;
      if (swapped.outcome == swap_outcome::refused) return std::nullopt;  // live: we lost
      // No file: make the first one, above every version an earlier file of
      // the key had (one a person removed, say), holding the key's version
      // floor until it is in place (detail/file_store/version_floor.hpp).
      auto floor = floor_of(name, t);
      const dibs::version v = floor.value() + 1;
      floor.cover(v);
      const auto tmp = write_temporary(v, true, value, name.key_line);
      // Its entry in the queue view before the record can be seen (there
      // is no old record whose entry would go).
      add_queue_entry(queue_place(true, value, name.name), name.name);
      const auto e = detail::link_new_record(tmp, path);
      (void)detail::remove_file(tmp);  // if we die before this, the next store to open the directory removes it
      if (e == 0) {
        sync_dir();
        return v;
      }
      if (!detail::file_exists(e)) throw detail::path_error(e, "dibs::file_store: cannot create record", path);
      // Someone made the file meanwhile: live (we lost) or erased (continue
      // from it). Something that is no record file (a symbolic link, a
      // directory) is reported by the next swap_if's open, so this ends.
    }
  }

  std::optional<dibs::version> replace(std::string_view key, dibs::version expected, std::string_view value) {
    return replace(key, expected, value, dibs::time_limit::max());
  }
  std::optional<dibs::version> replace(std::string_view key, dibs::version expected, std::string_view value,
                                       dibs::time_limit t) {
    const auto name = resolve(key, "dibs::file_store::replace");
    check_value(key, value, name);
    return swap_if(key, name, [&](const stored& cur) { return when(cur.live && cur.version == expected, value); }, true, t)
        .version;
  }

  bool erase(std::string_view key, dibs::version expected) { return erase(key, expected, dibs::time_limit::max()); }
  bool erase(std::string_view key, dibs::version expected, dibs::time_limit t) {
    const auto name = resolve(key, "dibs::file_store::erase");
    return swap_if(key, name, [&](const stored& cur) { return when(cur.live && cur.version == expected, {}); }, false, t)
               .outcome == swap_outcome::done;
  }

  /// Returns: the keys of the live records that start with `prefix`, read
  /// back from the file names (and from the records of cut names). Files
  /// that are no record of this store are not keys; a damaged record is
  /// listed (reading it reports the damage), except one of a cut name, whose
  /// key is only inside it.
  std::vector<std::string> keys(std::string_view prefix = {}) const {
    std::vector<std::string> out;
    const auto rc = detail::for_each_entry(dir_, [&](const detail::directory_entry& entry) {
      const std::string_view file = entry.name;
      if (entry.is_directory || file == "." || file == ".." || file.starts_with(".dibs-") ||
          file.size() <= opts_.suffix.size() || !file.ends_with(opts_.suffix))
        return;
      const std::string_view stem = file.substr(0, file.size() - opts_.suffix.size());
      std::optional<std::string> key = detail::key_of_stem(stem);
      try {
        auto r = detail::load_record(detail::child_path(dir_, file), dibs::time_limit::max());
        if (!r) return;  // gone meanwhile
        if (r->key) key = detail::unescape_key(*r->key);
        if (!key || !r->live) return;
      } catch (const std::system_error& e) {
        if (e.code() != errc::corrupt_record || !key) return;  // listed: reading it says what is wrong
      }
      if (key->starts_with(prefix)) out.push_back(std::move(*key));
    });
    if (rc != 0) throw detail::path_error(rc, "dibs::file_store: cannot list directory", dir_);
    return out;
  }

  /// Returns: the largest value a record holds: 1 MiB; on Windows, where
  /// every record is rewritten in place in a slot of its file, 12 KiB.
  static constexpr std::size_t max_value_size() noexcept {
    return detail::records_always_in_place ? 12 * 1024 : key_rules::max_value_size;
  }

  const std::filesystem::path& directory() const noexcept { return dir_; }
  /// Returns: "directory 'D'", for messages.
  std::string where() const { return fmt::format("directory '{}'", detail::path_text(dir_)); }
  /// Returns: the path of the file that holds `key`'s record (see the top
  /// of this file for how a key becomes a file name).
  std::filesystem::path path_of(std::string_view key) const { return detail::child_path(dir_, name_of(key, "dibs::file_store::path_of").name); }

  /// Effects: blocks until the file of `key` may have changed (inotify: a
  /// record put in place, or one rewritten in place), or `timeout` passes.
  /// (Not IN_CLOSE_WRITE: every compare-and-set opens an in-place record
  /// for writing, also one that is refused, and closing it would wake every
  /// waiter.) A change just before the call can be
  /// missed; callers re-read after at most `timeout` anyway.
  /// Returns: true if a change of the key was seen.
  bool wait_for_change(std::string_view key, std::chrono::nanoseconds timeout) const {
    const auto name = name_of(key, "dibs::file_store::wait_for_change").name;
#ifdef _WIN32
    // No notification on Windows yet: a short sleep, and the caller reads again.
    (void)name;
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(timeout, std::chrono::milliseconds{2}));
    return false;
#else
    return detail::wait_for_file_change(dir_, dir_ / name, name, timeout);
#endif
  }

#ifndef _WIN32  // on Windows a lock's waiters go unordered (docs/windows.md)
  /// The queue of this host's processes waiting for a lock on a key
  /// (detail/posix/waiter_queue.hpp); lease_mutex takes turns through it.
  using waiter_queue = detail::waiter_queue;
  /// Effects: opens the waiter queue of `key`'s lock, the file
  /// `.dibs-queue.<record file name>` beside the record, creating it (with
  /// the store's mode) if `create`. Returns: the queue, or an empty one
  /// where there is none or it cannot be used (a name too long for the
  /// prefix, no permission): the lock then goes unordered.
  /// Throws: errc::invalid_argument for a bad key.
  waiter_queue open_waiter_queue(std::string_view key, bool create) const {
    const std::string name = ".dibs-queue." + name_of(key, "dibs::file_store::open_waiter_queue").name;
    if (name.size() > detail::record_name_max) return {};
    return waiter_queue{dir_ / name, opts_.mode, create};
  }
#endif

  /// Effects: moves the record dibs 0.1 kept for `key` under the key itself
  /// (a key with '%', or starting ".dibs-", is now escaped) to the file this
  /// version keeps it in, with its version, state and value. Until then the
  /// key cannot be used (every operation on it reports where its record is),
  /// so an item done before the upgrade is never taken for absent. Call it
  /// when no process of dibs 0.1 uses the directory.
  /// Returns: true if a record was moved.
  /// Throws: errc::corrupt_record if the key has a record at both names.
  bool adopt_old_record(std::string_view key) {
    const auto name = name_of(key, "dibs::file_store::adopt_old_record");
    return detail::adopt_old_record(key, name, dir_, opts_.suffix, opts_.mode, opts_.sync);
  }

  /// The queue view (marker_claim's claim_next uses it: file_store models
  /// dibs::claim_queue_store). See the top of this file.
  ///
  /// Effects: takes up to `n` records whose key starts with `prefix` and
  /// that are claims offered or released whose not_before (if any) has come
  /// by this machine's clock, the highest priority first (within one, in
  /// random order), skipping records whose lock another process holds (it
  /// is taking or writing them): each is replaced, by a compare-and-set
  /// under its lock, with detail::claim_record::taken_head(attempts + 1,
  /// priority) followed by `rest`. It lists entries of the queue view, not
  /// the records: its cost does not grow with the items completed or
  /// failed. A missing view is rebuilt first (by one process; the others go
  /// on with what there is), and the view is checked against every record
  /// when file_store_options::queue_rescan has passed since the last check.
  /// Returns: the keys taken and their new records.
  /// Throws: std::system_error naming the path if a record or the view
  /// cannot be read or written (a damaged record is skipped, not reported:
  /// marker_claim's status() and list() report it).
  std::vector<std::pair<std::string, record>> take_claimable(std::string_view prefix, std::string_view rest,
                                                             std::uint32_t n, dibs::time_limit t) {
    (void)t;  // no wait for any other process: a record being written is skipped
    std::vector<std::pair<std::string, record>> out;
    if (n == 0) return out;
    check_view();
    namespace qv = detail::queue_view;
    const auto view = view_dir();
    std::lock_guard g{cache_.m};
    cache_.check_process();
    const auto now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
    // The scheduled entries: listed again when the earliest one known comes,
    // and at least every second (another process may have scheduled an
    // earlier one); those whose time has come wait in the cache, by priority.
    const auto steady_now = std::chrono::steady_clock::now();
    if (cache_.due.empty() && steady_now >= cache_.next_scheduled_list) {
      std::int64_t earliest = std::numeric_limits<std::int64_t>::max();
      for (auto& e : qv::list(view / qv::scheduled_name)) {
        std::int64_t nb = 0, prio = 0;
        std::string_view rec;
        if (!qv::parse_scheduled(e, nb, prio, rec)) continue;
        if (nb <= now_ms) cache_.due.emplace_back(prio, qv::candidate{view / qv::scheduled_name / e, std::string(rec)});
        else earliest = std::min(earliest, nb);
      }
      std::shuffle(cache_.due.begin(), cache_.due.end(), cache_.rng);
      std::stable_sort(cache_.due.begin(), cache_.due.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });  // highest at the back
      auto next = steady_now + std::chrono::seconds{1};
      if (earliest != std::numeric_limits<std::int64_t>::max())
        next = std::min(next, steady_now + std::chrono::milliseconds{earliest - now_ms});
      cache_.next_scheduled_list = next;
    }
    const auto priorities = qv::ready_priorities(view / qv::ready_name);
    const auto take_one = [&](const qv::candidate& c) {
      if (auto got = take_entry(c, prefix, rest, now_ms)) out.push_back(std::move(*got));
    };
    const auto take_due = [&](std::int64_t above) {  // the due scheduled entries of priority >= above
      for (auto i = cache_.due.size(); i-- > 0 && out.size() < n;) {
        if (cache_.due[i].first < above) break;
        if (!might_match(cache_.due[i].second.record, prefix)) continue;
        const auto c = std::move(cache_.due[i].second);
        cache_.due.erase(cache_.due.begin() + static_cast<std::ptrdiff_t>(i));
        take_one(c);
      }
    };
    for (const auto p : priorities) {
      take_due(p);
      if (out.size() >= n) break;
      auto& names = cache_.ready[{std::string(prefix), p}];
      const auto dir = view / qv::ready_name / std::to_string(p);
      for (int pass = 0; pass < 2 && out.size() < n; ++pass) {
        if (names.empty()) {
          if (pass == 1) break;  // listed and taken this call: the rest is gone
          for (auto& e : qv::list(dir))
            if (might_match(e, prefix)) names.push_back(std::move(e));
          if (names.empty()) {
            // Empty: its directory goes, so that a claim does not list an
            // emptied directory of many blocks (ext4 never shrinks one);
            // rmdir fails if a writer made an entry meanwhile, and a
            // writer whose directory is gone makes it again.
            std::error_code ec;
            std::filesystem::remove(dir, ec);
            break;
          }
          std::shuffle(names.begin(), names.end(), cache_.rng);
        }
        while (!names.empty() && out.size() < n) {
          qv::candidate c{dir / names.back(), std::move(names.back())};
          names.pop_back();
          take_one(c);
        }
        if (!names.empty()) break;
      }
      if (out.size() >= n) break;
    }
    take_due(std::numeric_limits<std::int64_t>::min());
    if (cache_.ready.size() > 64) cache_.ready.clear();  // many prefixes: forget them all
    return out;
  }

  /// Returns: the keys starting with `prefix` whose record is a processing
  /// claim, by the queue view's entries (the only claims a sweep can
  /// recover). A missing view is rebuilt first.
  std::vector<std::string> processing_keys(std::string_view prefix = {}) {
    check_view();
    namespace qv = detail::queue_view;
    std::vector<std::string> out;
    for (const auto& e : qv::list(view_dir() / qv::processing_name)) {
      std::optional<std::string> key;
      if (e.size() > opts_.suffix.size() && e.ends_with(opts_.suffix))
        key = detail::key_of_stem(std::string_view(e).substr(0, e.size() - opts_.suffix.size()));
      if (!key) key = key_in_record(e);  // a cut name: the key is in the record
      if (key && key->starts_with(prefix)) out.push_back(std::move(*key));
    }
    return out;
  }

  /// Effects: checks the queue view against every record now, as the
  /// periodic check does: makes the missing entries (of records a writer
  /// without the view wrote), removes the entries of processing claims
  /// that are none, and marks the view whole. Waits for a scan another
  /// process is making, then makes its own.
  /// Returns: how many entries were made.
  std::size_t rebuild_queue_view() {
    auto lock = view_lock();
    lock.lock();
    return scan_view();
  }

private:
  using stored = detail::stored_record;
  using file_name = detail::record_file_name;

  // Throws: errc::invalid_argument naming the key if `value` is larger
  // than max_value_size().
  static void check_value(std::string_view key, std::string_view value, const file_name& name) {
    validate_value(key, value);
    if constexpr (detail::records_always_in_place) {
      (void)name;
      if (value.size() > max_value_size())
        throw std::system_error(make_error_code(errc::invalid_argument),
                                fmt::format("dibs::file_store: value for key '{}' is {} bytes; on Windows a record is "
                                            "rewritten in place and holds at most {}: keep larger data in a file "
                                            "of its own and its name in the value",
                                            detail::show_key(key), value.size(), max_value_size()));
    }
  }

  // Returns: the file of `key`. Throws: errc::invalid_argument naming `call`
  // for a key no store takes, or, with key_is_file_name, one that is no file name.
  file_name name_of(std::string_view key, std::string_view call) const {
    return detail::record_name_of(key, call, dir_, opts_.suffix, opts_.key_is_file_name);
  }

  // name_of, and the check that no record of dibs 0.1 holds the key under
  // the name it had then, which would make an item done before the upgrade
  // look absent.
  file_name resolve(std::string_view key, std::string_view call) const {
    file_name name = name_of(key, call);
    detail::refuse_old_record(key, name, call, dir_, opts_.suffix);
    return name;
  }

  // Throws: errc::corrupt_record naming the file unless `s` is the record of
  // `key` (a record of another key, or of dibs 0.1 at an escaped name).
  void check_key(const stored& s, std::string_view key, const file_name& name, const std::filesystem::path& path) const {
    detail::check_record_key(s, key, name, path, opts_.suffix);
  }

  // Throws: errc::invalid_argument naming the directory if names there are
  // compared without case (a case-folding ext4 directory, chattr +F; vfat,
  // exFAT, SMB): two keys that differ only in case would share one file.
  void refuse_case_folding() const {
    if (const char* why = detail::case_folding(dir_))
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::file_store: directory '{}' compares names without case ({}): keys "
                                          "that differ only in case would share one record file; use a directory "
                                          "on a case-sensitive filesystem",
                                          detail::path_text(dir_), why));
  }

  // Writes a whole record to a fresh temporary file; returns its path.
  std::filesystem::path write_temporary(dibs::version v, bool live, std::string_view value,
                                        std::string_view key_line) const {
    return detail::write_temporary(dir_, opts_.mode, opts_.sync, detail::encode_record(v, live, value, key_line));
  }

  void sync_dir() const { detail::sync_record_directory(dir_, opts_.sync); }

  // The version floor that covers the record file `name`, held: one per
  // directory, on a descriptor kept open, for a store of its own directory;
  // one per record file where the key is the file's name (lock files, in
  // directories shared with other programs and users).
  detail::version_floor floor_of(const file_name& name, dibs::time_limit t) { return floor_of_record(name.name, t); }
  detail::version_floor floor_of_record(std::string_view record, dibs::time_limit t) {
    if (opts_.key_is_file_name)
      return detail::version_floor{dir_, detail::floor_name_of(record), opts_.mode, opts_.sync, t};
    return detail::version_floor{dir_, std::string(detail::directory_floor_name), opts_.mode, opts_.sync, t, &floor_kept_};
  }

  enum class swap_outcome { no_file, refused, done };
  struct swap_result {
    swap_outcome outcome = swap_outcome::no_file;
    std::optional<dibs::version> version;  // set when done
  };

  // What a compare-and-set also does to the queue view while it holds the
  // record's lock (take_claimable and the full scan): `came_by`, an entry
  // it was reached through, is removed unless it is the record's place;
  // with `ensure`, the entry of the record's place is made if missing.
  struct view_fix {
    const std::filesystem::path* came_by = nullptr;
    bool ensure = false;
  };

  // Returns: `value` if `ok`, else nothing (a compare-and-set's decision).
  static std::optional<std::string_view> when(bool ok, std::string_view value) {
    return ok ? std::optional<std::string_view>{value} : std::nullopt;
  }

  // Compare-and-set: under the record file's flock, if decide(current)
  // gives a value, puts a new record (current version + 1) in its place,
  // live with that value or erased. A record written
  // in place is reached through the descriptor kept from the last operation
  // on it, if there is one (kept_record.hpp): its identity is known, and the
  // lstat under the flock says whether the path still names it.
  // The queue view is kept in step while the record's lock is held: the new
  // record's entry is made before the record can be seen, so it is never
  // missing once this returns; the old record's entry is removed after,
  // still under the lock (a new file is locked before it is put in place),
  // so that no writer after us can make an entry at that path which we
  // then remove.
  template <class Decide>
  swap_result swap_if(std::string_view key, const file_name& name, Decide decide, bool live, dibs::time_limit t,
                      view_fix fix = view_fix{nullptr, false}) {
    const auto path = detail::child_path(dir_, name.name);
    for (;;) {
      bool in_place = detail::records_always_in_place || ((opts_.in_place || sticky_) && !opts_.sync);
      detail::record_handle fd = in_place ? kept_.take(name.name) : detail::record_handle{};
      if (!fd) {
        auto e = fd.open(path, name.name, in_place);
        if (e != 0 && in_place && detail::write_denied(e)) {  // not ours to write: by a new file instead
          in_place = false;
          e = fd.open(path, name.name, false);
        }
        if (e != 0) {
          if (detail::file_missing(e)) return {};
          throw detail::record_open_error(e, path);
        }
        fd.check_regular(path);
      }
      in_place = in_place && fd.writable();
      detail::lock_record(fd.get(), detail::file_lock_kind::exclusive, path, t);
      // Replaced while we waited (or since the descriptor was kept)? Then it
      // is a dead inode: again, by the path.
      bool same = false;
      if (const auto e = fd.names_this(path, same)) {
        if (detail::file_missing(e)) return {};
        throw detail::path_error(e, "dibs::file_store: cannot stat record", path);
      }
      if (!same) continue;
      const auto cur = detail::load_record(fd.get(), path, opts_.empty_is_free);
      if (cur) check_key(*cur, key, name, path);
      const auto old_place = cur ? queue_place(cur->live, cur->value, name.name) : detail::queue_view::place{};
      const std::optional<std::string_view> value = cur ? decide(*cur) : std::nullopt;
      if (!value) {
        fix_view(fix, old_place, name.name);
        keep(std::move(fd), in_place);
        return {swap_outcome::refused, std::nullopt};
      }
      const auto new_place = queue_place(live, *value, name.name);
      if (new_place != old_place) add_queue_entry(new_place, name.name);
      // After the new record is in place, under its lock: the old entry goes.
      const auto settle = [&] {
        if (new_place != old_place) remove_queue_entry(old_place, name.name);
        fix_view(fix, new_place, name.name);
      };
      dibs::version next = std::max(cur->version + 1, cur->next_after_torn);
      // Into a new window of versions: raise the key's floor first, so that a
      // record made after this file is removed starts above `next`. An empty
      // file (empty_is_free: version 0) holds no versions: the record put
      // into it starts above the floor, as one made from nothing does.
      if (cur->version == 0 || detail::floor_window_end(next) > detail::floor_window_end(cur->version)) {
        auto floor = floor_of(name, t);
        if (cur->version == 0) next = std::max(next, floor.value() + 1);
        floor.cover(next);
      }
      if (in_place) {
        const std::string rec = detail::encode_record(next, live, live ? *value : std::string_view{}, name.key_line);
        if (cur->file_size == 0) {  // an empty file (empty_is_free): the record goes at its start, as in a new file
          detail::write_first_record(fd.get(), rec, path);
          settle();
          keep(std::move(fd), in_place);
          return {swap_outcome::done, next};
        }
        if (detail::fits_in_slots(*cur, rec)) {
          detail::write_other_slot(fd.get(), *cur, rec, path);
          if constexpr (detail::records_always_in_place) {
            // Windows: slots of 16 KiB span several pages, which the system
            // may write back in any order, so the old slot is never marked
            // stale (a mark on disk before the new slot would leave no
            // whole record after a power loss); readers take the higher
            // version. With `sync` the new slot is flushed before returning.
            if (opts_.sync)
              if (const auto e = detail::sync_data(fd.get())) throw detail::path_error(e, "dibs::file_store: cannot flush record", path);
          } else {
            detail::mark_stale(fd.get(), *cur);
          }
          settle();
          keep(std::move(fd), in_place);
          return {swap_outcome::done, next};
        }
      }
#ifdef _WIN32
      // Windows cannot put a new file over one others may have open: a
      // record is always rewritten in place (validate_value keeps it small
      // enough), so this is a file this user may not write.
      throw detail::path_error(fd.writable() ? ERROR_FILE_TOO_LARGE : ERROR_ACCESS_DENIED,
                               "dibs::file_store: cannot rewrite record", path);
#else
      const auto tmp = write_temporary(next, live, live ? *value : std::string_view{}, name.key_line);
      // The new file is locked before it is in place when the view has an
      // entry to remove after it: a writer that opens it then waits for us.
      detail::record_handle born;
      if (new_place != old_place || fix.came_by || fix.ensure) {
        if (const auto e = born.open(tmp, name.name, false)) {
          (void)detail::remove_file(tmp);
          throw detail::path_error(e, "dibs::file_store: cannot open the new record", tmp);
        }
        detail::lock_record(born.get(), detail::file_lock_kind::exclusive, tmp, dibs::time_limit::max());
      }
      detail::put_in_place(tmp, path, fd.stat());
      sync_dir();
      settle();
      return {swap_outcome::done, next};  // the flock goes with the old inode when fd closes (and born's)
#endif
    }
  }

  // The queue view (detail/file_store/queue_view.hpp) beside the records.
  std::filesystem::path view_dir() const { return dir_ / std::string(detail::queue_view::dir_name); }
  static detail::queue_view::place queue_place(bool live, std::string_view value, std::string_view record) {
    return detail::queue_view::place_of(live, value, record);
  }
  void add_queue_entry(const detail::queue_view::place& p, std::string_view record) const {
    if (p.kind == detail::queue_view::where::none) return;
    detail::queue_view::add_entry(detail::queue_view::entry_path(view_dir(), p, record), opts_.mode);
  }
  void remove_queue_entry(const detail::queue_view::place& p, std::string_view record) const {
    if (p.kind == detail::queue_view::where::none) return;
    detail::queue_view::remove_entry(detail::queue_view::entry_path(view_dir(), p, record));
  }
  // Requires: the record's lock, and `p` the place of its current record.
  void fix_view(const view_fix& fix, const detail::queue_view::place& p, std::string_view record) const {
    if (!fix.came_by && !fix.ensure) return;
    const auto right = detail::queue_view::entry_path(view_dir(), p, record);
    if (fix.came_by && *fix.came_by != right) detail::queue_view::remove_entry(*fix.came_by);
    if (fix.ensure && !right.empty() && !detail::queue_view::exists(right)) add_queue_entry(p, record);
  }

  // Effects: drops `fd`'s flock and keeps it for the next operation on its
  // record, if it is one written in place; else closes it (dropping the flock).
  void keep(detail::record_handle&& fd, bool in_place) noexcept {
    if (in_place && fd.unlock()) kept_.keep(std::move(fd));
  }

  // The key of the record file `record`, from its name, or from its record
  // for a cut name; nothing if it is no record of this store.
  std::optional<std::string> key_in_record(std::string_view record) const {
    if (record.size() <= opts_.suffix.size() || !record.ends_with(opts_.suffix)) return std::nullopt;
    std::optional<std::string> key = detail::key_of_stem(record.substr(0, record.size() - opts_.suffix.size()));
    if (key) return key;
    try {
      const auto r = detail::load_record(detail::child_path(dir_, record), dibs::time_limit::max());
      if (r && r->key) return detail::unescape_key(*r->key);
    } catch (const std::system_error&) {
      // damaged or unreadable: not listed here; status() reports it
    }
    return std::nullopt;
  }

  // Returns: false if the record file `record` certainly holds no key
  // starting with `prefix` (read from its name; a cut name may).
  bool might_match(std::string_view record, std::string_view prefix) const {
    if (prefix.empty()) return true;
    if (record.size() <= opts_.suffix.size() || !record.ends_with(opts_.suffix)) return false;
    const auto key = detail::key_of_stem(record.substr(0, record.size() - opts_.suffix.size()));
    return !key || key->starts_with(prefix);
  }

  // take_claimable's try of one entry: the record's lock is tried, not
  // waited for (its holder is taking or writing it). Returns: the key and
  // new record if it was taken.
  std::optional<std::pair<std::string, record>> take_entry(const detail::queue_view::candidate& c,
                                                           std::string_view prefix, std::string_view rest,
                                                           std::int64_t now_ms) {
    if (!detail::queue_view::exists(c.entry)) return std::nullopt;  // taken by another worker since listed
    const auto key = key_in_record(c.record);
    std::optional<file_name> name;
    try {
      if (key) name = resolve(*key, "dibs::file_store::take_claimable");
    } catch (const std::system_error&) {
      // a key no store takes, or one whose dibs 0.1 record is in the way: not ours to take
    }
    if (!key || !name || name->name != c.record) {
      // No record of a key of this store (or not at that name): an entry
      // of nothing. Without a record there is nothing for a writer to keep in step.
      if (!key && !detail::queue_view::exists(detail::child_path(dir_, c.record))) remove_entry_of_missing(c.entry, c.record);
      return std::nullopt;
    }
    if (!key->starts_with(prefix)) return std::nullopt;
    std::string taken;
    const view_fix fix{&c.entry, false};
    try {
      const auto r = swap_if(
          *key, *name,
          [&](const stored& cur) -> std::optional<std::string_view> {
            if (!cur.live) return std::nullopt;
            const auto h = detail::claim_record::parse_head(cur.value);
            if (!h || !h->claimable_at(now_ms)) return std::nullopt;
            taken = detail::claim_record::taken_head(std::uint64_t{h->attempts.value_or(0)} + 1, h->priority);
            taken += rest;
            return taken;
          },
          true, std::chrono::steady_clock::now(), fix);
      if (r.outcome == swap_outcome::no_file) remove_entry_of_missing(c.entry, c.record);
      if (r.outcome != swap_outcome::done) return std::nullopt;
      return std::pair<std::string, record>{*key, record{std::move(taken), *r.version}};
    } catch (const std::system_error& e) {
      if (e.code() == errc::timed_out) return std::nullopt;  // its lock is held: another worker's
      if (e.code() == errc::corrupt_record) {
        // Damaged: no entry (a person repairs it; the next full scan puts
        // it back); status() and list() report it.
        detail::queue_view::remove_entry(c.entry);
        return std::nullopt;
      }
      throw;
    }
  }

  // Effects: removes the queue view's entry `entry` of the record file
  // `record`, found with no record, unless the record is there by now. A
  // creator makes a new record's entry before it links the record, both
  // while it holds the floor's flock (create): so once we hold the floor, a
  // record still missing has no creator on its way, and the entry is one of
  // a creator that died or failed, or of a record a person removed. (Without
  // the floor, a claim that lists the entry between a creator's two steps
  // would remove it, and the record would wait for the next full check.)
  // A floor held past a second: the entry stays, for the next look.
  void remove_entry_of_missing(const std::filesystem::path& entry, std::string_view record) {
    try {
      auto floor = floor_of_record(record, std::chrono::steady_clock::now() + std::chrono::seconds{1});
      if (!detail::queue_view::exists(detail::child_path(dir_, record))) detail::queue_view::remove_entry(entry);
    } catch (const std::system_error& e) {
      if (e.code() != errc::timed_out) throw;
    }
  }

  // The kernel lock that lets one process at a time scan all the records.
  file_mutex view_lock() const {
    detail::queue_view::make_directories(view_dir(), opts_.mode);
    return file_mutex{view_dir() / std::string(detail::queue_view::lock_name)};
  }

  // Effects: rebuilds the view if it is not whole (no format file: never
  // made, or removed), or checks it if queue_rescan has passed since the
  // last check; by one process, the others go on at once.
  void check_view() {
    namespace qv = detail::queue_view;
    const auto view = view_dir();
    bool due = !qv::exists(view / qv::format_name);
    if (!due && opts_.queue_rescan != std::chrono::seconds::max()) {
      std::error_code ec;
      const auto at = std::filesystem::last_write_time(view / qv::scanned_name, ec);
      due = ec || std::filesystem::file_time_type::clock::now() - at >= opts_.queue_rescan;
    }
    if (!due) return;
    auto lock = view_lock();
    if (!lock.try_lock()) return;  // another process is scanning
    // Scanned by another process just before we locked?
    if (qv::exists(view / qv::format_name) && opts_.queue_rescan != std::chrono::seconds::max()) {
      std::error_code ec;
      const auto at = std::filesystem::last_write_time(view / qv::scanned_name, ec);
      if (!ec && std::filesystem::file_time_type::clock::now() - at < opts_.queue_rescan) return;
    } else if (qv::exists(view / qv::format_name) && opts_.queue_rescan == std::chrono::seconds::max()) {
      return;
    }
    scan_view();
  }

  // Requires: the view's scan lock. Effects: as rebuild_queue_view().
  // Every entry is made and removed under its record's lock, as a writer's
  // are: the scan reads each record without it first, and takes it only
  // where the view disagrees.
  std::size_t scan_view() {
    namespace qv = detail::queue_view;
    const auto view = view_dir();
    for (const auto d : {qv::ready_name, qv::scheduled_name, qv::processing_name})
      qv::make_directories(view / d, opts_.mode);
    std::size_t made = 0;
    // Under the record's lock, waiting a little for a writer (which keeps
    // the entry itself when it writes; one refused keeps nothing, so the
    // next scan looks again).
    const auto fix_under_lock = [&](std::string_view record, const std::filesystem::path* came_by) {
      const auto key = key_in_record(record);
      if (!key) return;
      try {
        const auto name = resolve(*key, "dibs::file_store::rebuild_queue_view");
        if (name.name != record) return;
        (void)swap_if(*key, name, [](const stored&) { return std::optional<std::string_view>{}; }, true,
                      std::chrono::steady_clock::now() + std::chrono::seconds{1}, view_fix{came_by, came_by == nullptr});
      } catch (const std::system_error& e) {
        if (e.code() != errc::timed_out && e.code() != errc::corrupt_record && e.code() != errc::invalid_argument) throw;
      }
    };
    std::vector<std::string> records;
    const auto rc = detail::for_each_entry(dir_, [&](const detail::directory_entry& entry) {
      const std::string_view file = entry.name;
      if (entry.is_directory || file.starts_with(".") || file.size() <= opts_.suffix.size() ||
          !file.ends_with(opts_.suffix))
        return;
      records.emplace_back(file);
    });
    if (rc != 0) throw detail::path_error(rc, "dibs::file_store: cannot list directory", dir_);
    for (const auto& rec : records) {
      std::optional<stored> r;
      try {
        r = detail::load_record(detail::child_path(dir_, rec), dibs::time_limit::max(), opts_.empty_is_free);
      } catch (const std::system_error& e) {
        if (e.code() != errc::corrupt_record && e.code() != errc::timed_out) throw;
        continue;  // damaged: no entry
      }
      if (!r) continue;
      const auto p = queue_place(r->live, r->value, rec);
      if (p.kind == qv::where::none || qv::exists(qv::entry_path(view, p, rec))) continue;
      fix_under_lock(rec, nullptr);
      ++made;
    }
    // Entries of processing claims that are none now (a writer killed
    // between a record and its old entry's removal; a scan that raced a
    // writer): the sweep would read them again and again.
    for (const auto& e : qv::list(view / qv::processing_name)) {
      std::optional<stored> r;
      try {
        r = detail::load_record(detail::child_path(dir_, e), dibs::time_limit::max(), opts_.empty_is_free);
      } catch (const std::system_error& err) {
        if (err.code() != errc::corrupt_record && err.code() != errc::timed_out) throw;
      }
      if (r && queue_place(r->live, r->value, e).kind == qv::where::processing) continue;
      const auto entry = view / qv::processing_name / e;
      if (!r) remove_entry_of_missing(entry, e);
      else if (!key_in_record(e)) qv::remove_entry(entry);
      else fix_under_lock(e, &entry);
    }
    write_view_file(qv::format_name, qv::format_text);
    write_view_file(qv::scanned_name, "the time of this file is when the queue view was last checked against every record\n");
    return made;
  }

  // Effects: (re)writes the small file `name` of the view, whole (a
  // temporary file renamed over it). Throws: std::system_error naming it.
  void write_view_file(std::string_view name, std::string_view text) const {
    const auto view = view_dir();
    const auto tmp = detail::write_temporary(view, opts_.mode, false, text);
    const auto dst = view / std::string(name);
    std::error_code ec;
    std::filesystem::rename(tmp, dst, ec);
    if (ec) {
      (void)detail::remove_file(tmp);
      throw std::system_error(ec, fmt::format("dibs::file_store: cannot write the queue view's file '{}'",
                                              detail::path_text(dst)));
    }
  }

  std::filesystem::path dir_;
  file_store_options opts_;
  bool sticky_ = false;
  detail::kept_record kept_;  // the descriptor of the last record written in place
  detail::kept_record floor_kept_;  // the descriptor of the directory's version floor
  mutable detail::queue_view::cache cache_;  // what this process remembers of the queue view
};

static_assert(listable_store<file_store>);
static_assert(timed_shared_store<file_store>);
// claim_queue_store<file_store> (a concept of marker_claim.hpp, which a
// store does not include) is asserted in tests/file_store_test.cpp.

}  // namespace dibs
