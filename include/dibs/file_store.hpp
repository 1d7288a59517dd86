// dibs/file_store.hpp: a dibs::shared_store of one file per key in a
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
//     tokens);
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
// was not current either.
// One host or many: flock, link and rename are atomic on local filesystems;
// over NFS only link is (use a server-backed store there).
#pragma once

#include <dirent.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <fcntl.h>
#include <signal.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/vfs.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <boost/crc.hpp>
#include <fmt/format.h>

#include <dibs/backoff.hpp>
#include <dibs/detail/fork_fds.hpp>
#include <dibs/detail/owner.hpp>
#include <dibs/detail/posix.hpp>
#include <dibs/error.hpp>
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
  mode_t mode = 0644;
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
};

class file_store {
public:
  /// Effects: opens the store in an existing directory and removes temporary
  /// files left by processes that are gone.
  /// Throws: std::system_error naming the directory if it is missing, not a
  /// directory, or not writable by this user.
  explicit file_store(std::filesystem::path directory, file_store_options opts = {})
      : dir_(std::move(directory)), opts_(opts) {
    struct ::stat st {};
    if (::stat(dir_.c_str(), &st) != 0) throw detail::path_error(errno, "dibs::file_store: cannot open directory", dir_);
    if (!S_ISDIR(st.st_mode)) throw detail::path_error(ENOTDIR, "dibs::file_store: not a directory:", dir_);
    if (::access(dir_.c_str(), W_OK | X_OK) != 0)
      throw detail::path_error(errno, "dibs::file_store: cannot write to directory", dir_);
    // In a sticky directory (/tmp) only a file's owner may replace it, so
    // records are rewritten in place there, which any user who may write
    // the file can do (file_store_options::mode).
    sticky_ = (st.st_mode & S_ISVTX) != 0;
    if (!opts_.key_is_file_name) refuse_case_folding();
    remove_dead_temporaries();
  }

  /// Returns: the live record of `key`, or nothing.
  /// Throws: std::system_error(errc::corrupt_record) naming the file if it is
  /// damaged or not a dibs record; errc::invalid_argument for a bad key.
  std::optional<record> read(std::string_view key) const { return read(key, dibs::time_limit::max()); }
  /// Effects, Returns, Throws: as read(key); errc::timed_out if the record
  /// is caught mid-write and its writer has not finished by `t`.
  std::optional<record> read(std::string_view key, dibs::time_limit t) const {
    const auto name = resolve(key, "dibs::file_store::read");
    const auto path = dir_ / name.name;
    auto r = load(path, t);
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
    validate_value(key, value);
    const auto path = dir_ / name.name;
    for (;;) {
      // An erased record keeps the key's version: continue from it, under the
      // record's lock, without first writing a file that link() would refuse.
      const auto swapped = swap_if(key, name, [](const stored& c) { return !c.live; }, true, value, t);
      if (swapped.outcome == swap_outcome::done) return swapped.version;
      if (swapped.outcome == swap_outcome::refused) return std::nullopt;  // live: we lost
      const auto tmp = write_temporary(1, true, value, name.key_line);  // no file: make the first one
      if (::link(tmp.c_str(), path.c_str()) == 0) {
        ::unlink(tmp.c_str());
        sync_dir();
        return dibs::version{1};
      }
      const int e = errno;
      ::unlink(tmp.c_str());
      if (e != EEXIST) throw detail::path_error(e, "dibs::file_store: cannot create record", path);
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
    validate_value(key, value);
    return swap_if(key, name, [&](const stored& cur) { return cur.live && cur.version == expected; }, true, value, t)
        .version;
  }

  bool erase(std::string_view key, dibs::version expected) { return erase(key, expected, dibs::time_limit::max()); }
  bool erase(std::string_view key, dibs::version expected, dibs::time_limit t) {
    const auto name = resolve(key, "dibs::file_store::erase");
    return swap_if(key, name, [&](const stored& cur) { return cur.live && cur.version == expected; }, false, {}, t)
               .outcome == swap_outcome::done;
  }

  /// Returns: the keys of the live records that start with `prefix`, read
  /// back from the file names (and from the records of cut names). Files
  /// that are no record of this store are not keys; a damaged record is
  /// listed (reading it reports the damage), except one of a cut name, whose
  /// key is only inside it.
  std::vector<std::string> keys(std::string_view prefix = {}) const {
    std::vector<std::string> out;
    std::unique_ptr<DIR, int (*)(DIR*)> d{::opendir(dir_.c_str()), ::closedir};
    if (!d) throw detail::path_error(errno, "dibs::file_store: cannot list directory", dir_);
    while (const dirent* entry = ::readdir(d.get())) {
      const std::string_view file = entry->d_name;
      if (entry->d_type == DT_DIR || file == "." || file == ".." || file.starts_with(".dibs-") ||
          file.size() <= opts_.suffix.size() || !file.ends_with(opts_.suffix))
        continue;
      const std::string_view stem = file.substr(0, file.size() - opts_.suffix.size());
      std::optional<std::string> key = key_of(stem);
      try {
        auto r = load(dir_ / file, dibs::time_limit::max());
        if (!r) continue;  // gone meanwhile
        if (r->key) key = unescape(*r->key);
        if (!key || !r->live) continue;
      } catch (const std::system_error& e) {
        if (e.code() != errc::corrupt_record || !key) continue;  // listed: reading it says what is wrong
      }
      if (key->starts_with(prefix)) out.push_back(std::move(*key));
    }
    return out;
  }

  const std::filesystem::path& directory() const noexcept { return dir_; }
  /// Returns: the path of the file that holds `key`'s record (see the top
  /// of this file for how a key becomes a file name).
  std::filesystem::path path_of(std::string_view key) const { return dir_ / name_of(key, "dibs::file_store::path_of").name; }

  /// Effects: blocks until the file of `key` may have changed (inotify: a
  /// record put in place, or one rewritten in place), or `timeout` passes.
  /// (Not IN_CLOSE_WRITE: every compare-and-set opens an in-place record
  /// for writing, also one that is refused, and closing it would wake every
  /// waiter.) A change just before the call can be
  /// missed; callers re-read after at most `timeout` anyway.
  /// Returns: true if a change of the key was seen.
  bool wait_for_change(std::string_view key, std::chrono::nanoseconds timeout) const {
    detail::unique_fd fd{::inotify_init1(IN_CLOEXEC | IN_NONBLOCK)};
    const auto sleep_instead = [&] {
      std::this_thread::sleep_for(timeout);
      return false;
    };
    if (!fd) return sleep_instead();
    if (::inotify_add_watch(fd.get(), dir_.c_str(), IN_CREATE | IN_DELETE | IN_MOVED_TO | IN_MOVED_FROM) < 0)
      return sleep_instead();
    // Writes in place are watched on the file itself: IN_MODIFY on the
    // directory would also report every write to every other file there
    // (a lock file usually sits beside the log it guards).
    const int file_watch = ::inotify_add_watch(fd.get(), path_of(key).c_str(), IN_MODIFY);  // -1: no file yet
    const std::string name = name_of(key, "dibs::file_store::wait_for_change").name;
    const auto end = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      pollfd p{fd.get(), POLLIN, 0};
      const int rc = ::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(0, left.count() + 1)));
      if (rc <= 0) return false;
      alignas(inotify_event) char buf[4096];
      const ssize_t n = ::read(fd.get(), buf, sizeof buf);
      for (ssize_t off = 0; off < n;) {
        const auto* ev = reinterpret_cast<const inotify_event*>(buf + off);
        if ((ev->len > 0 && name == ev->name) || (file_watch >= 0 && ev->wd == file_watch)) return true;
        off += static_cast<ssize_t>(sizeof(inotify_event) + ev->len);
      }
      if (std::chrono::steady_clock::now() >= end) return false;
    }
  }

private:
  struct stored {
    dibs::version version = 0;
    bool live = false;
    std::string value;
    std::size_t offset = 0;  // where the record starts in its file: 0, or slot_size
    std::size_t end = 0;     // where it ends
    std::size_t file_size = 0;
    std::optional<std::string> key;  // its `key` line (escaped), if it has one
    // The other slot is not whole (a write cut short): the least version
    // the next write may use so that none seen before is reused.
    dibs::version next_after_torn = 0;
  };
  // in_place: the two slots of a record file are [0, slot_size) and
  // [slot_size, 2 * slot_size), so that one write of a slot (with the padding
  // before it) stays within the file's first page.
  static constexpr std::size_t slot_size = 2048;
  // in_place: what replaces a record once a newer one is whole in the other
  // slot; readers skip a slot that holds it and padding. It starts as a
  // record does, so that a dibs before issue 12, which does not know it,
  // takes it for a torn slot: it then reads again under the flock and finds
  // the current record (where it would report a file that starts otherwise
  // as not a record).
  static constexpr std::string_view stale_prefix = "dibs-record 1\nstale copy, not the record: ";
  static constexpr std::string_view stale_first =
      "dibs-record 1\nstale copy, not the record: the current record is further down, at byte 2048\n";
  static constexpr std::string_view stale_second =
      "dibs-record 1\nstale copy, not the record: the current record is the one above\n";

  // Returns: true if `slot` (a slot's bytes, to its end) is a stale mark and
  // padding.
  static bool marked_stale(std::string_view slot) noexcept {
    if (slot.substr(0, stale_prefix.size()) != stale_prefix) return false;
    const auto nl = slot.find('\n', stale_prefix.size());
    return nl != std::string_view::npos && slot.find_first_not_of('\n', nl) == std::string_view::npos;
  }

  static std::uint32_t crc(std::string_view header, std::string_view value) noexcept {
    boost::crc_32_type c;
    c.process_bytes(header.data(), header.size());
    c.process_bytes(value.data(), value.size());
    return c.checksum();
  }

  // `key_line`: the escaped key, for a record whose name does not spell it.
  static std::string encode(dibs::version v, bool live, std::string_view value, std::string_view key_line) {
    std::string header = fmt::format("dibs-record 1\nversion {}\nstate {}\nsize {}\n", v, live ? "live" : "erased",
                                     value.size());
    if (!key_line.empty()) header += fmt::format("key {}\n", key_line);
    std::string out = header + fmt::format("crc32 {:08x}\n\n", crc(header, value));
    out.append(value);
    return out;
  }

  [[noreturn]] static void corrupt(const std::filesystem::path& path, std::string_view why) {
    throw std::system_error(make_error_code(errc::corrupt_record),
                            fmt::format("dibs::file_store: record file '{}' is damaged or not a dibs record ({}); "
                                        "do not delete or move it away (for a claim, the item would be handled "
                                        "again): restore it from a backup, or find out the key's state and write "
                                        "the record again",
                                        path.string(), why));
  }

  // Parses the record at the start of `text`, which may go on past it.
  // Returns: the record (its `end` relative to `text`), or nothing with
  // `why` saying what is wrong.
  static std::optional<stored> parse_one(std::string_view text, std::string& why) {
    const std::string_view all = text;
    std::string_view field;
    auto line = [&](std::string_view prefix) {
      if (text.substr(0, prefix.size()) != prefix) {
        why = fmt::format("expected '{}'", prefix);
        return false;
      }
      const auto nl = text.find('\n');
      if (nl == std::string_view::npos) {
        why = "header cut short";
        return false;
      }
      field = text.substr(prefix.size(), nl - prefix.size());
      text.remove_prefix(nl + 1);
      return true;
    };
    auto number = [&](int base, std::uint64_t& n) {
      const auto [p, ec] = std::from_chars(field.data(), field.data() + field.size(), n, base);
      if (ec == std::errc{} && p == field.data() + field.size()) return true;
      why = fmt::format("bad number '{}'", field);
      return false;
    };
    if (text.substr(0, 12) == "dibs-record " && text.substr(0, 14) != "dibs-record 1\n") {
      why = "a record format this version of dibs does not read";
      return std::nullopt;
    }
    stored s;
    std::uint64_t size = 0, sum = 0;
    if (!line("dibs-record 1") || !line("version ") || !number(10, s.version) || !line("state ")) return std::nullopt;
    if (field != "live" && field != "erased") {
      why = fmt::format("unknown state '{}'", field);
      return std::nullopt;
    }
    s.live = field == "live";
    if (!line("size ") || !number(10, size)) return std::nullopt;
    if (text.starts_with("key ")) {
      if (!line("key ")) return std::nullopt;
      s.key = std::string(field);
    }
    const std::string_view header = all.substr(0, all.size() - text.size());
    if (!line("crc32 ") || !number(16, sum) || !line("")) return std::nullopt;
    if (!field.empty()) {
      why = "no blank line after the header";
      return std::nullopt;
    }
    if (text.size() < size) {
      why = fmt::format("value has {} bytes, header says {}", text.size(), size);
      return std::nullopt;
    }
    const std::string_view value = text.substr(0, size);
    if (crc(header, value) != sum) {
      why = "checksum mismatch";
      return std::nullopt;
    }
    s.value = std::string(value);
    s.end = all.size() - text.size() + size;
    return s;
  }

  // Returns: the current record of a file's whole text. A file rewritten in
  // place holds a record in each of its two slots; the current one is the
  // whole one with the higher version. `strict`: for a reader without the
  // lock, which may catch a slot mid-write: every slot must then be whole
  // (one whole slot is not enough: the other may hold a newer record that
  // it caught half-copied), else errc::corrupt_record and it reads again.
  static stored decode(const std::filesystem::path& path, std::string_view all, bool strict) {
    const auto only_padding = [](std::string_view rest) { return rest.find_first_not_of('\n') == std::string_view::npos; };
    std::string why0, why1;
    auto r0 = parse_one(all, why0);
    if (r0) r0->file_size = all.size();
    if (r0 && r0->end > slot_size) {  // larger than a slot: a record written whole to a new file
      if (!only_padding(all.substr(r0->end))) corrupt(path, fmt::format("{} bytes follow the record", all.size() - r0->end));
      return *r0;
    }
    const bool two = all.size() > slot_size;
    if (r0 && !only_padding(all.substr(r0->end, (two ? slot_size : all.size()) - r0->end))) {
      r0.reset();
      why0 = "bytes other than padding follow the record";
    }
    if (!two) {
      if (!r0) corrupt(path, why0);
      return *r0;
    }
    const bool stale0 = !r0 && marked_stale(all.substr(0, slot_size));
    auto r1 = parse_one(all.substr(slot_size), why1);
    if (r1) {
      r1->offset = slot_size;
      r1->end += slot_size;
      r1->file_size = all.size();
      if (!only_padding(all.substr(r1->end))) {
        r1.reset();
        why1 = "bytes other than padding follow the second record";
      }
    }
    if (r0 && r1) return r0->version > r1->version ? *r0 : *r1;
    // One whole record and the old slot marked stale after it was written:
    // the usual state, for a reader with the lock or without.
    if (r0 && marked_stale(all.substr(slot_size))) return *r0;
    if (r1 && stale0) return *r1;
    // Under the lock, one slot whole and the other not: the other holds a
    // write cut short (its writer died; a write of ours touches only the slot
    // that is not current), however far it got, also after several such
    // cuts, so the whole one is current and the key is never wedged. Its
    // version was never returned to anyone (only whole slots are), but the
    // next write skips past whatever the torn header names, and one more:
    // if the damage came from outside instead and hit the current slot, no
    // version it had handed out is handed out again.
    if (!strict && (r0 || r1)) {
      stored& whole = r0 ? *r0 : *r1;
      const auto v = header_version(r0 ? all.substr(slot_size) : all);
      whole.next_after_torn = std::max(whole.version, v.value_or(0)) + 2;
      return whole;
    }
    corrupt(path, r0 ? "second slot: " + why1 : why0);
  }

  // Returns: the version a record's header names, if its first two lines are whole.
  static std::optional<dibs::version> header_version(std::string_view text) {
    constexpr std::string_view start = "dibs-record 1\nversion ";
    if (text.substr(0, start.size()) != start) return std::nullopt;
    text.remove_prefix(start.size());
    dibs::version v = 0;
    const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc{} || p == text.data() + text.size() || *p != '\n') return std::nullopt;
    return v;
  }

  // Returns: the length a record claims in its header (header + value), or
  // 0 if the text does not yet hold a whole header.
  static std::size_t declared_length(std::string_view text) noexcept {
    const auto at = text.find("\nsize ");
    if (at == std::string_view::npos) return 0;
    std::uint64_t size = 0;
    const char* first = text.data() + at + 6;
    const auto [p, ec] = std::from_chars(first, text.data() + text.size(), size);
    if (ec != std::errc{}) return 0;
    const auto end = text.find("\n\n", static_cast<std::size_t>(p - text.data()));
    if (end == std::string_view::npos) return 0;
    return end + 2 + static_cast<std::size_t>(size);
  }

  // Returns: true if `text` ends where its record(s) say the file ends. A
  // stale mark is looked for first: it is followed by padding, in which
  // declared_length's search would stop at every newline.
  // The second slot's record may be followed by padding up to the size the
  // file had (a shorter record in place of a longer one).
  static bool read_whole(std::string_view text) noexcept {
    if (text.size() > slot_size) {
      const auto second = text.substr(slot_size);
      if (marked_stale(second)) return true;
      const auto d = declared_length(second);
      if (d != 0 && d <= second.size() && second.find_first_not_of('\n', d) == std::string_view::npos) return true;
      if (marked_stale(text.substr(0, slot_size))) return false;
    }
    return declared_length(text) == text.size();
  }

  // Reads the whole file. A read shorter than asked that brings the text to
  // exactly the length its header declares (of the second slot's record, in
  // a file with two) is the end of the file: no second read() just to see it
  // return 0.
  static std::optional<std::string> slurp(int fd, const std::filesystem::path& path) {
    std::string out;
    char buf[65536];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw detail::path_error(errno, "dibs::file_store: cannot read record", path);
      if (n == 0) return out;
      out.append(buf, static_cast<std::size_t>(n));
      if (static_cast<std::size_t>(n) < sizeof buf && read_whole(out)) return out;
    }
  }

  // Reads a record without its lock. A slot rewritten in place may be caught
  // half-copied: then the file is read again under a shared flock, which
  // waits for the writer; only what is damaged then too is reported.
  static std::optional<stored> load(const std::filesystem::path& path, dibs::time_limit t) {
    detail::fork_closed_fd fd{path.c_str(), O_RDONLY | record_open_flags};
    if (!fd) {
      if (errno == ENOENT) return std::nullopt;
      throw open_error(errno, path);
    }
    {
      const auto text = slurp(fd.get(), path);
      try {
        return decode(path, *text, true);
      } catch (const std::system_error& e) {
        // Only a record of ours can be mid-write; a foreign file is reported
        // at once, not after waiting for whoever may hold a flock on it.
        if (e.code() != errc::corrupt_record || text->substr(0, 14) != "dibs-record 1\n") throw;
      }
    }
    lock_record(fd.get(), LOCK_SH, path, t);
    if (::lseek(fd.get(), 0, SEEK_SET) != 0) throw detail::path_error(errno, "dibs::file_store: cannot read record", path);
    return load(fd.get(), path);
  }
  // Requires: the record's flock (no writer is mid-write).
  static std::optional<stored> load(int fd, const std::filesystem::path& path) {
    return decode(path, *slurp(fd, path), false);
  }

  // Record files are opened without following a symbolic link, and without
  // blocking on a FIFO someone put there (check_regular reports both).
  static constexpr int record_open_flags = O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY;

  static std::system_error open_error(int e, const std::filesystem::path& path) {
    struct ::stat st {};
    if (e == ELOOP && ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
      return std::system_error(std::error_code{e, std::system_category()},
                               fmt::format("dibs::file_store: record path '{}' is a symbolic link; dibs does not follow "
                                           "a link there (in a shared directory it could point anywhere): remove it",
                                           path.string()));
    return detail::path_error(e, "dibs::file_store: cannot open record", path);
  }

  static void check_regular(const struct ::stat& st, const std::filesystem::path& path) {
    if (!S_ISREG(st.st_mode))
      throw std::system_error(std::error_code{S_ISDIR(st.st_mode) ? EISDIR : EINVAL, std::system_category()},
                              fmt::format("dibs::file_store: record path '{}' is not a regular file (a {}): move it away",
                                          path.string(), S_ISDIR(st.st_mode) ? "directory" : "device, FIFO or socket"));
  }

  // Takes the record's flock (`op`: LOCK_EX or LOCK_SH). Without a deadline
  // it blocks in the kernel; with one it polls, because flock(2) takes no
  // timeout and a library must not take a signal from its program to
  // interrupt it. Throws: errc::timed_out at `t`.
  static void lock_record(int fd, int op, const std::filesystem::path& path, dibs::time_limit t) {
    const bool timed = t != dibs::time_limit::max();
    const exponential_backoff schedule{std::chrono::microseconds{20}, 2.0, std::chrono::milliseconds{1}, jitter::equal};
    thread_local std::minstd_rand rng{std::random_device{}()};
    for (std::uint64_t n = 0;; ++n) {
      if (::flock(fd, op | (timed ? LOCK_NB : 0)) == 0) return;
      if (errno == EINTR) continue;
      if (!timed || errno != EWOULDBLOCK) throw detail::path_error(errno, "dibs::file_store: cannot lock record", path);
      const auto left = t - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero())
        throw std::system_error(make_error_code(errc::timed_out),
                                fmt::format("dibs::file_store: record '{}' is held by another process that has not "
                                            "let go in the time given (is it stopped?)",
                                            path.string()));
      const double u = std::uniform_real_distribution<double>{0.0, 1.0}(rng);
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(left, schedule.delay(n, {}, u)));
    }
  }

  // The name of a temporary file of this process: everything the proof rule
  // needs to judge its maker gone, and a random part. Returns: the name.
  static std::string temporary_name() {
    thread_local std::mt19937_64 rng{std::random_device{}()};
    const detail::owner_id& me = detail::this_process_base();
    std::string boot;
    for (const char c : me.boot)
      if (c != '-') boot += c;
    return fmt::format("{}{}.{}.{}.{}.{}.{:016x}", temporary_prefix, boot.empty() ? "0" : boot, me.pid_ns, me.time_ns,
                       me.pid, me.start, rng());
  }
  static constexpr std::string_view temporary_prefix = ".dibs-tmp.";

  // Writes a whole record to a fresh temporary file; returns its path.
  std::filesystem::path write_temporary(dibs::version v, bool live, std::string_view value,
                                        std::string_view key_line) const {
    const auto tmp = dir_ / temporary_name();
    detail::unique_fd fd{detail::open_retry(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, opts_.mode)};
    if (!fd) throw detail::path_error(errno, "dibs::file_store: cannot create a temporary file in", dir_);
    // The mode exactly, not narrowed by the umask: a record other users
    // share must stay writable by them.
    if (::fchmod(fd.get(), opts_.mode) != 0) {
      const int e = errno;
      ::unlink(tmp.c_str());
      throw detail::path_error(e, "dibs::file_store: cannot set the permissions of a temporary file in", dir_);
    }
    const std::string data = encode(v, live, value, key_line);
    std::size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = ::write(fd.get(), data.data() + done, data.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int e = n < 0 ? errno : ENOSPC;
        ::unlink(tmp.c_str());
        throw detail::path_error(e, "dibs::file_store: cannot write a record into", dir_);
      }
      done += static_cast<std::size_t>(n);
    }
    if (opts_.sync && ::fsync(fd.get()) != 0) {
      const int e = errno;
      ::unlink(tmp.c_str());
      throw detail::path_error(e, "dibs::file_store: cannot fsync a record in", dir_);
    }
    return tmp;
  }

  void sync_dir() const {
    if (!opts_.sync) return;
    detail::unique_fd d{detail::open_retry(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
    if (!d || ::fsync(d.get()) != 0) throw detail::path_error(errno, "dibs::file_store: cannot fsync directory", dir_);
  }

  // The file of a key: its name, and the `key` line its record carries when
  // the name does not spell the key (empty when it does).
  struct file_name {
    std::string name;
    std::string key_line;
  };
  static constexpr std::size_t name_max = 255;  // NAME_MAX of Linux's filesystems
  static constexpr std::string_view cut_mark = "%~";

  // Returns: `key` with the bytes a file name cannot hold, or that would make
  // names ambiguous, written %XX (see the top of this file).
  static std::string escape(std::string_view key) {
    const bool hide_dot = key == "." || key == ".." || key.starts_with(".dibs-");
    std::string out;
    out.reserve(key.size());
    for (std::size_t i = 0; i < key.size(); ++i) {
      const auto c = static_cast<unsigned char>(key[i]);
      if (c == '/' || c == '%' || c < 0x20 || c == 0x7f || (i == 0 && hide_dot)) out += fmt::format("%{:02X}", c);
      else out += key[i];
    }
    return out;
  }

  // Returns: the key `escaped` spells, if escape() makes exactly it.
  static std::optional<std::string> unescape(std::string_view escaped) {
    std::string out;
    for (std::size_t i = 0; i < escaped.size(); ++i) {
      if (escaped[i] != '%') {
        out += escaped[i];
        continue;
      }
      unsigned v = 0;
      const auto* first = escaped.data() + i + 1;
      if (i + 3 > escaped.size() || std::from_chars(first, first + 2, v, 16).ptr != first + 2) return std::nullopt;
      out += static_cast<char>(v);
      i += 2;
    }
    if (out.empty() || escape(out) != escaped) return std::nullopt;
    return out;
  }

  // Returns: the key a file name's stem spells, if it spells one (a cut name
  // does not: its key is in its record). A name with '%' that escape() does
  // not make is a key of dibs 0.1, spelled as it is.
  static std::optional<std::string> key_of(std::string_view stem) {
    if (stem.find(cut_mark) != std::string_view::npos) return std::nullopt;
    if (stem.find('%') == std::string_view::npos) return std::string(stem);
    if (auto k = unescape(stem)) return k;
    return std::string(stem);
  }

  // Returns: the file of `key`. Throws: errc::invalid_argument naming `call`
  // for a key no store takes, or, with key_is_file_name, one that is no file name.
  file_name name_of(std::string_view key, std::string_view call) const {
    validate_key(key, call);
    if (opts_.key_is_file_name) {
      const char* rule = key.find('/') != std::string_view::npos    ? "it holds '/'"
                         : key.find('\0') != std::string_view::npos ? "it holds a NUL byte"
                         : key == "." || key == ".."                 ? "'.' and '..' name directories"
                         : key.size() + opts_.suffix.size() > name_max ? "a file name has at most 255 bytes"
                                                                       : nullptr;
      if (rule)
        throw std::system_error(make_error_code(errc::invalid_argument),
                                fmt::format("{}: '{}' in '{}' cannot be a file name: {}", call, detail::show_key(key),
                                            dir_.string(), rule));
      return {std::string(key) + opts_.suffix, {}};
    }
    std::string stem = escape(key);
    bool spelled = stem == key;
    if (stem.size() + opts_.suffix.size() > name_max) {
      spelled = false;
      // Cut where no %XX or UTF-8 character is split, then the mark and a
      // 64-bit FNV-1a hash of the key; the record keeps the whole key.
      std::size_t n = name_max - opts_.suffix.size() - cut_mark.size() - 16;
      while (n > 0 && (stem[n - 1] == '%' || (n > 1 && stem[n - 2] == '%') ||
                       (static_cast<unsigned char>(stem[n]) & 0xc0) == 0x80))
        --n;
      std::uint64_t h = 1469598103934665603ull;
      for (const char c : key) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
      stem = fmt::format("{}{}{:016x}", stem.substr(0, n), cut_mark, h);
    }
    return {stem + opts_.suffix, spelled ? std::string{} : escape(key)};
  }

  // name_of, and the check that no record of dibs 0.1 holds the key under
  // the name it had then (the key itself: dibs 0.1 took keys without '/'
  // and control bytes, of at most 200 bytes), which would make an item done
  // before the upgrade look absent.
  file_name resolve(std::string_view key, std::string_view call) const {
    file_name name = name_of(key, call);
    const bool old_key = key.size() <= 200 && key != "." && key != ".." &&
                         std::none_of(key.begin(), key.end(), [](char ch) {
                           const auto c = static_cast<unsigned char>(ch);
                           return c == '/' || c < 0x20 || c == 0x7f;
                         });
    if (name.key_line.empty() || !old_key) return name;
    const auto old_path = dir_ / (std::string(key) + opts_.suffix);
    std::optional<stored> old;
    try {
      old = load(old_path, dibs::time_limit::max());
    } catch (const std::system_error& e) {
      // A file there that is no dibs record is not the key's. Anything else
      // (a damaged record of ours, a file that cannot be read now) may be
      // the key's old record: reported, never taken for "none".
      if (e.code() != errc::corrupt_record || starts_as_record(old_path)) throw;
      return name;
    }
    if (old && !old->key)
      throw std::system_error(
          make_error_code(errc::corrupt_record),
          fmt::format("{}: the record of key '{}' is in '{}', the name dibs 0.1 gave it; this version keeps it in "
                      "'{}'. Once no process of dibs 0.1 uses the directory, move it there with "
                      "file_store::adopt_old_record(key) (not with mv: the record must learn its key)",
                      call, detail::show_key(key), old_path.string(), (dir_ / name.name).string()));
    return name;
  }

public:
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
    if (name.key_line.empty() || key.size() > 200) return false;  // its name is what it was
    const auto old_path = dir_ / (std::string(key) + opts_.suffix), new_path = dir_ / name.name;
    detail::fork_closed_fd fd{old_path.c_str(), O_RDONLY | record_open_flags};
    if (!fd) {
      if (errno == ENOENT) return false;
      throw open_error(errno, old_path);
    }
    lock_record(fd.get(), LOCK_EX, old_path, dibs::time_limit::max());
    const auto old = load(fd.get(), old_path);
    if (!old || old->key) return false;  // a record of this version: another key's
    const auto tmp = write_temporary(old->version, old->live, old->value, name.key_line);
    if (::link(tmp.c_str(), new_path.c_str()) != 0) {
      const int e = errno;
      ::unlink(tmp.c_str());
      if (e == EEXIST)
        throw std::system_error(make_error_code(errc::corrupt_record),
                                fmt::format("dibs::file_store::adopt_old_record: key '{}' has a record at its old name "
                                            "'{}' and at its new one '{}': keep both, and find out which is right",
                                            detail::show_key(key), old_path.string(), new_path.string()));
      throw detail::path_error(e, "dibs::file_store: cannot create record", new_path);
    }
    ::unlink(tmp.c_str());
    if (::unlink(old_path.c_str()) != 0) throw detail::path_error(errno, "dibs::file_store: cannot remove", old_path);
    sync_dir();
    return true;
  }

private:

  // Throws: errc::invalid_argument naming the directory if names there are
  // compared without case (a case-folding ext4 directory, chattr +F; vfat,
  // exFAT, SMB): two keys that differ only in case would share one file.
  void refuse_case_folding() const {
    const char* why = nullptr;
    struct ::statfs fs {};
    if (::statfs(dir_.c_str(), &fs) == 0) {
      const auto type = static_cast<unsigned long>(fs.f_type);
      if (type == MSDOS_SUPER_MAGIC) why = "a vfat filesystem";
      else if (type == EXFAT_SUPER_MAGIC) why = "an exFAT filesystem";
      else if (type == CIFS_SUPER_MAGIC || type == SMB2_SUPER_MAGIC) why = "an SMB share";
    }
    detail::unique_fd d{detail::open_retry(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
    long flags = 0;
    if (!why && d && ::ioctl(d.get(), FS_IOC_GETFLAGS, &flags) == 0 && (flags & FS_CASEFOLD_FL)) why = "case-folding (chattr +F)";
    if (why)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::file_store: directory '{}' compares names without case ({}): keys "
                                          "that differ only in case would share one record file; use a directory "
                                          "on a case-sensitive filesystem",
                                          dir_.string(), why));
  }

  // Returns: true if the file at `path` begins as a record of dibs does.
  static bool starts_as_record(const std::filesystem::path& path) {
    detail::unique_fd fd{detail::open_retry(path.c_str(), O_RDONLY | record_open_flags)};
    char head[12] = {};
    return fd && ::read(fd.get(), head, sizeof head) == static_cast<ssize_t>(sizeof head) &&
           std::string_view(head, sizeof head) == "dibs-record ";
  }

  // Throws: errc::corrupt_record naming the file unless `s` is the record of
  // `key` (a record of another key, or of dibs 0.1 at an escaped name).
  void check_key(const stored& s, std::string_view key, const file_name& name, const std::filesystem::path& path) const {
    const std::string_view want = name.key_line.empty() ? key : std::string_view(name.key_line);
    if (s.key ? *s.key == want : name.key_line.empty()) return;
    throw std::system_error(
        make_error_code(errc::corrupt_record),
        s.key ? fmt::format("dibs::file_store: '{}' holds the record of key '{}', not of '{}' (two keys whose names "
                            "were cut alike); keep the file, and key one of them otherwise",
                            path.string(), detail::show_key(unescape(*s.key).value_or(*s.key)), detail::show_key(key))
              : fmt::format("dibs::file_store: '{}' holds a record of dibs 0.1 for the key '{}', not one for '{}': "
                            "keep the file (the key it belongs to may be done); the key '{}' cannot be used in this "
                            "directory while it is there",
                            path.string(), detail::show_key(name.name.substr(0, name.name.size() - opts_.suffix.size())),
                            detail::show_key(key), detail::show_key(key)));
  }

  enum class swap_outcome { no_file, refused, done };
  struct swap_result {
    swap_outcome outcome = swap_outcome::no_file;
    std::optional<dibs::version> version;  // set when done
  };

  // Compare-and-set: under the record file's flock, if ok(current) holds,
  // puts a new record (current version + 1) in its place.
  template <class Pred>
  swap_result swap_if(std::string_view key, const file_name& name, Pred ok, bool live, std::string_view value,
                      dibs::time_limit t) {
    const auto path = dir_ / name.name;
    for (;;) {
      bool in_place = (opts_.in_place || sticky_) && !opts_.sync;
      std::optional<detail::fork_closed_fd> fd;
      fd.emplace(path.c_str(), (in_place ? O_RDWR : O_RDONLY) | record_open_flags);
      if (!*fd && in_place && (errno == EACCES || errno == EPERM || errno == EROFS)) {  // not ours to write: by a new file instead
        in_place = false;
        fd.reset();
        fd.emplace(path.c_str(), O_RDONLY | record_open_flags);
      }
      if (!*fd) {
        if (errno == ENOENT) return {};
        throw open_error(errno, path);
      }
      lock_record(fd->get(), LOCK_EX, path, t);
      // Replaced while we waited? Then our descriptor is a dead inode: again.
      struct ::stat held {}, now {};
      if (::fstat(fd->get(), &held) != 0) throw detail::path_error(errno, "dibs::file_store: cannot stat record", path);
      check_regular(held, path);
      if (::lstat(path.c_str(), &now) != 0) {
        if (errno == ENOENT) return {};
        throw detail::path_error(errno, "dibs::file_store: cannot stat record", path);
      }
      if (held.st_ino != now.st_ino || held.st_dev != now.st_dev) continue;
      const auto cur = load(fd->get(), path);
      if (cur) check_key(*cur, key, name, path);
      if (!cur || !ok(*cur)) return {swap_outcome::refused, std::nullopt};
      const dibs::version next = std::max(cur->version + 1, cur->next_after_torn);
      if (in_place) {
        const std::string rec = encode(next, live, value, name.key_line);
        // Only where the current record and the file stay within the two
        // slots (a record larger than a slot was written whole, to a new file).
        if (rec.size() <= slot_size && cur->end - cur->offset <= slot_size && cur->file_size <= 2 * slot_size) {
          write_other_slot(fd->get(), *cur, rec, path);
          mark_stale(fd->get(), *cur);
          return {swap_outcome::done, next};
        }
      }
      const auto tmp = write_temporary(next, live, value, name.key_line);
      put_in_place(tmp, path, held);
      sync_dir();
      return {swap_outcome::done, next};  // the flock goes with the old inode when fd closes
    }
  }

  // Writes `rec` (at most slot_size bytes) into the slot that does not hold
  // `cur`, in one pwrite that stays within the first page, with newlines
  // around it where the slot's old bytes would otherwise remain. Nothing of
  // `cur` is touched, so if the write fails or the process dies in it, `cur`
  // is still the file's whole current record.
  static void write_other_slot(int fd, const stored& cur, const std::string& rec, const std::filesystem::path& path) {
    std::string data;
    off_t at;
    if (cur.offset == 0) {  // into the second slot, padding from the end of `cur`
      at = static_cast<off_t>(cur.end);
      data.assign(slot_size - cur.end, '\n');
      data += rec;
      if (slot_size + rec.size() < cur.file_size) data.append(cur.file_size - slot_size - rec.size(), '\n');
    } else {  // into the first slot, padded to where the second begins
      at = 0;
      data = rec;
      data.append(slot_size - rec.size(), '\n');
    }
    ssize_t n;
    do n = ::pwrite(fd, data.data(), data.size(), at);
    while (n < 0 && errno == EINTR);
    if (n == static_cast<ssize_t>(data.size())) return;
    throw detail::path_error(n < 0 ? errno : ENOSPC, "dibs::file_store: cannot rewrite record", path);
  }

  // Overwrites the record `old` (no longer current: a newer one is whole in
  // the other slot, its pwrite returned) with a stale mark and padding, so
  // that a person reading the file sees only the current record. Best effort:
  // a mark that fails leaves an older, whole record, which readers pass over
  // for its lower version; one cut short is a torn slot that was not
  // current. Both slots are in the file's first page, written back together.
  static void mark_stale(int fd, const stored& old) noexcept {
    const std::string_view mark = old.offset == 0 ? stale_first : stale_second;
    char data[slot_size];  // no allocation: nothing here may fail after the new record is in
    const std::size_t size = std::max(mark.size(), std::min(old.end - old.offset, slot_size));
    std::memset(data, '\n', size);
    std::memcpy(data, mark.data(), mark.size());
    ssize_t n;
    do n = ::pwrite(fd, data, size, static_cast<off_t>(old.offset));
    while (n < 0 && errno == EINTR);
  }

  // Atomically makes `path` name the record in `tmp`. An exchange, then an
  // unlink of the old record (now at `tmp`), rather than rename() over the
  // path: ext4 flushes the data of a file renamed over another
  // (auto_da_alloc), which made every replace ~10x slower here (see
  // docs/BENCHMARKS.md). Readers see the old inode or the new one either way.
  static void put_in_place(const std::filesystem::path& tmp, const std::filesystem::path& path, const struct ::stat& old) {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, path.c_str(), RENAME_EXCHANGE) == 0) {
      ::unlink(tmp.c_str());  // if we die before this, the next store to open the directory removes it
      return;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
      const int e = errno;
      ::unlink(tmp.c_str());
      throw replace_error(e, path, old);
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {  // a filesystem without RENAME_EXCHANGE
      const int e = errno;
      ::unlink(tmp.c_str());
      throw replace_error(e, path, old);
    }
  }

  // The error for a record that may not be replaced; in a sticky directory
  // (/tmp) that is another user's file, which only its owner may replace.
  static std::system_error replace_error(int e, const std::filesystem::path& path, const struct ::stat& old) {
    struct ::stat dir {};
    const auto parent = path.has_parent_path() ? path.parent_path() : std::filesystem::path{"."};
    if ((e == EPERM || e == EACCES) && ::stat(parent.c_str(), &dir) == 0 && (dir.st_mode & S_ISVTX) &&
        old.st_uid != ::geteuid())
      return std::system_error(
          std::error_code{e, std::system_category()},
          fmt::format("dibs::file_store: cannot replace record '{}': it belongs to another user (uid {}, mode {:04o}) "
                      "in a sticky directory, where only its owner may replace it; records shared by several users "
                      "need a mode that lets all of them write it in place (file_store_options::mode, lock_file's "
                      "mode: 0664 with a shared group, or 0666)",
                      path.string(), old.st_uid, old.st_mode & 07777));
    return detail::path_error(e, "dibs::file_store: cannot replace record", path);
  }

  // Returns: true if `name` is a temporary file of dibs whose maker is
  // provably gone: exactly the form temporary_name() makes, from this boot,
  // judged by the rule every policy uses. Any other file is never touched.
  static bool dead_temporary(std::string_view name) {
    if (name.substr(0, temporary_prefix.size()) != temporary_prefix) return false;
    name.remove_prefix(temporary_prefix.size());
    std::string_view parts[6];
    for (int i = 0; i < 6; ++i) {
      const auto dot = name.find('.');
      if ((dot == std::string_view::npos) != (i == 5)) return false;
      parts[i] = name.substr(0, dot);
      name.remove_prefix(dot == std::string_view::npos ? name.size() : dot + 1);
    }
    auto number = [](std::string_view f, auto& v, int base = 10) {
      const auto [p, ec] = std::from_chars(f.data(), f.data() + f.size(), v, base);
      return !f.empty() && ec == std::errc{} && p == f.data() + f.size();
    };
    detail::process_identity p;
    std::uint64_t random = 0;
    if (!number(parts[1], p.pid_ns) || !number(parts[2], p.time_ns) || !number(parts[3], p.pid) ||
        !number(parts[4], p.start) || parts[5].size() != 16 || !number(parts[5], random, 16))
      return false;
    std::string boot;
    for (const char c : detail::this_process_base().boot)
      if (c != '-') boot += c;
    if (boot.empty() || parts[0] != boot) return false;  // another machine or boot: cannot judge
    return detail::provably_gone(p);
  }

  void remove_dead_temporaries() const {
    DIR* d = ::opendir(dir_.c_str());
    if (!d) return;
    while (const dirent* e = ::readdir(d))
      if (dead_temporary(e->d_name)) ::unlinkat(::dirfd(d), e->d_name, 0);
    ::closedir(d);
  }

  std::filesystem::path dir_;
  file_store_options opts_;
  bool sticky_ = false;
};

static_assert(listable_store<file_store>);
static_assert(timed_shared_store<file_store>);

}  // namespace dibs
