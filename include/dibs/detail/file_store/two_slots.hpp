// dibs/detail/file_store/two_slots.hpp: a record file rewritten in place
// (file_store_options::in_place) holds two slots of 2 KiB in its first
// page, the current record in one; a write goes into the other, and then
// the old one is marked stale. Here: which record of a file's text is
// current (one record, or two slots, whole, torn or marked), whether a read
// has the whole file, and the two writes of an in-place update. Separate
// because the crash safety of writing in place rests on exactly these
// rules: a writer killed at any point damages only a slot that is not current.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include <dibs/detail/record_file.hpp>
#include <dibs/detail/sys.hpp>
#include <dibs/detail/file_store/record_format.hpp>

namespace dibs::detail {

// The two slots of a record file are [0, record_slot_size) and
// [record_slot_size, 2 * record_slot_size), so that one write of a slot
// (with the padding before it) stays within the file's first page. On
// Windows every record is rewritten in place (detail/win32/record_file.hpp),
// so a slot there holds the largest key's record line too (1 KiB of key,
// escaped: 3 KiB) and file_store's largest value there (12 KiB).
#ifdef _WIN32
inline constexpr std::size_t record_slot_size = 16384;
#else
inline constexpr std::size_t record_slot_size = 2048;
#endif

// What replaces a record once a newer one is whole in the other slot;
// readers skip a slot that holds it and padding. It starts as a record
// does, so that a dibs before issue 12, which does not know it, takes it
// for a torn slot: it then reads again under the flock and finds the
// current record (where it would report a file that starts otherwise as
// not a record).
inline constexpr std::string_view stale_slot_prefix = "dibs-record 1\nstale copy, not the record: ";
#ifdef _WIN32
inline constexpr std::string_view stale_first_slot =
    "dibs-record 1\nstale copy, not the record: the current record is further down, at byte 16384\n";
#else
inline constexpr std::string_view stale_first_slot =
    "dibs-record 1\nstale copy, not the record: the current record is further down, at byte 2048\n";
#endif
inline constexpr std::string_view stale_second_slot =
    "dibs-record 1\nstale copy, not the record: the current record is the one above\n";

// Returns: true if `slot` (a slot's bytes, to its end) is a stale mark and
// padding.
inline bool marked_stale(std::string_view slot) noexcept {
  if (slot.substr(0, stale_slot_prefix.size()) != stale_slot_prefix) return false;
  const auto nl = slot.find('\n', stale_slot_prefix.size());
  return nl != std::string_view::npos && slot.find_first_not_of('\n', nl) == std::string_view::npos;
}

// Returns: the current record of a file's whole text. A file rewritten in
// place holds a record in each of its two slots; the current one is the
// whole one with the higher version. `strict`: for a reader without the
// lock, which may catch a slot mid-write: every slot must then be whole
// (one whole slot is not enough: the other may hold a newer record that
// it caught half-copied), else errc::corrupt_record and it reads again.
inline stored_record decode_record_file(const std::filesystem::path& path, std::string_view all, bool strict) {
  constexpr std::size_t slot_size = record_slot_size;
  const auto only_padding = [](std::string_view rest) { return rest.find_first_not_of('\n') == std::string_view::npos; };
  std::string why0, why1;
  auto r0 = parse_record(all, why0);
  if (r0) r0->file_size = all.size();
  if (r0 && r0->end > slot_size) {  // larger than a slot: a record written whole to a new file
    if (!only_padding(all.substr(r0->end)))
      corrupt_record(path, fmt::format("{} bytes follow the record", all.size() - r0->end));
    return *r0;
  }
  const bool two = all.size() > slot_size;
  if (r0 && !only_padding(all.substr(r0->end, (two ? slot_size : all.size()) - r0->end))) {
    r0.reset();
    why0 = "bytes other than padding follow the record";
  }
  if (!two) {
    if (!r0) corrupt_record(path, why0);
    return *r0;
  }
  const bool stale0 = !r0 && marked_stale(all.substr(0, slot_size));
  auto r1 = parse_record(all.substr(slot_size), why1);
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
    stored_record& whole = r0 ? *r0 : *r1;
    const auto v = record_header_version(r0 ? all.substr(slot_size) : all);
    whole.next_after_torn = std::max(whole.version, v.value_or(0)) + 2;
    return whole;
  }
  corrupt_record(path, r0 ? "second slot: " + why1 : why0);
}

// Returns: true if `text` ends where its record(s) say the file ends. A
// stale mark is looked for first: it is followed by padding, in which
// record_declared_length's search would stop at every newline.
// The second slot's record may be followed by padding up to the size the
// file had (a shorter record in place of a longer one).
inline bool read_whole_file(std::string_view text) noexcept {
  if (text.size() > record_slot_size) {
    const auto second = text.substr(record_slot_size);
    if (marked_stale(second)) return true;
    const auto d = record_declared_length(second);
    if (d != 0 && d <= second.size() && second.find_first_not_of('\n', d) == std::string_view::npos) return true;
    if (marked_stale(text.substr(0, record_slot_size))) return false;
  }
  return record_declared_length(text) == text.size();
}

// Returns: whether a record `rec` may be written in place over `cur`: the
// current record and the file stay within the two slots (a record larger
// than a slot was written whole, to a new file).
inline bool fits_in_slots(const stored_record& cur, const std::string& rec) noexcept {
  return rec.size() <= record_slot_size && cur.end - cur.offset <= record_slot_size &&
         cur.file_size <= 2 * record_slot_size;
}

// Writes `rec` (at most record_slot_size bytes) into the slot that does not
// hold `cur`, in one pwrite that stays within the first page, with newlines
// around it where the slot's old bytes would otherwise remain. Nothing of
// `cur` is touched, so if the write fails or the process dies in it, `cur`
// is still the file's whole current record.
inline void write_other_slot(native_file fd, const stored_record& cur, const std::string& rec,
                             const std::filesystem::path& path) {
  constexpr std::size_t slot_size = record_slot_size;
  std::string data;
  std::uint64_t at;
  if (cur.offset == 0) {  // into the second slot, padding from the end of `cur`
    at = cur.end;
    data.assign(slot_size - cur.end, '\n');
    data += rec;
    if (slot_size + rec.size() < cur.file_size) data.append(cur.file_size - slot_size - rec.size(), '\n');
  } else {  // into the first slot, padded to where the second begins
    at = 0;
    data = rec;
    data.append(slot_size - rec.size(), '\n');
  }
  if (const int e = write_at(fd, data.data(), data.size(), at))
    throw path_error(e, "dibs::file_store: cannot rewrite record", path);
}

// Writes `rec` at the start of an empty file, in one pwrite: a reader sees
// the file empty, or the record (whole, or being written: read again under
// the flock, see load_record).
inline void write_first_record(native_file fd, const std::string& rec, const std::filesystem::path& path) {
  if (const int e = write_at(fd, rec.data(), rec.size(), 0))
    throw path_error(e, "dibs::file_store: cannot write record", path);
}

// Overwrites the record `old` (no longer current: a newer one is whole in
// the other slot, its pwrite returned) with a stale mark and padding, so
// that a person reading the file sees only the current record. Best effort:
// a mark that fails leaves an older, whole record, which readers pass over
// for its lower version; one cut short is a torn slot that was not
// current. Both slots are in the file's first page, written back together.
inline void mark_stale(native_file fd, const stored_record& old) noexcept {
  const std::string_view mark = old.offset == 0 ? stale_first_slot : stale_second_slot;
  char data[record_slot_size];  // no allocation: nothing here may fail after the new record is in
  const std::size_t size = std::max(mark.size(), std::min(old.end - old.offset, record_slot_size));
  std::memset(data, '\n', size);
  std::memcpy(data, mark.data(), mark.size());
  (void)write_at(fd, data, size, old.offset);
}

}  // namespace dibs::detail
