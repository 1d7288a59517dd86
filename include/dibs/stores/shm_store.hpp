// dibs/stores/shm_store.hpp: a dibs::shared_store in POSIX shared memory
// (Boost.Interprocess), for the fastest coordination between processes of
// one host.
//
//   dibs::shm_store store{"myapp-claims"};          // /dev/shm/myapp-claims
//   dibs::marker_claim<dibs::shm_store> claims{store};
//
// The segment is a fixed table of slots (open addressing), each with a key,
// a version and a value of at most `max_value` bytes, behind one robust,
// process-shared mutex. A process killed at any instant never wedges the
// others: the kernel hands the mutex to the next process with EOWNERDEAD, and
// that process rolls back the one slot the dead one was changing, from an
// undo copy taken before every change. Versions come from one counter for
// the whole segment, so they grow across erase and re-create; a new segment
// starts that counter at the wall clock in nanoseconds, so they grow across
// a removed segment (rm /dev/shm/<name>) and a reboot too.
//
// The segment is set up under a dibs::file_mutex on the segment itself (the
// kernel releases it if the process setting up dies), and set up anew after
// a reboot. It lives until remove(name) or the next reboot.
#pragma once

#ifdef _WIN32
// Boost.Interprocess's mutexes on Windows are not robust: one whose holder
// dies stays locked, and every other process would wait forever, which is
// the wedge shm_store exists to rule out. A port would use a named Win32
// mutex (its next waiter gets WAIT_ABANDONED) beside the mapping.
#error "dibs/stores/shm_store.hpp is not ported to Windows: Boost.Interprocess's Windows mutexes stay locked when their holder dies, which would wedge every other process; use sqlite_store (or memory_store within one process) there; docs/windows.md lists the headers that are ported"
#endif

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <fmt/format.h>

#include <dibs/detail/posix/robust_mutex.hpp>
#include <dibs/error.hpp>
#include <dibs/file_mutex.hpp>
#include <dibs/store.hpp>

namespace dibs {

struct shm_store_options {
  std::uint32_t capacity = 4096;   ///< slots: live keys plus erased ones awaiting reuse
  std::uint32_t max_value = 4096;  ///< bytes of value per slot
  /// How long an operation waits for the segment's mutex before errc::timed_out.
  std::chrono::milliseconds lock_timeout{10'000};
};

namespace detail {

struct shm_header {
  // '2': keys of up to 1024 bytes (a segment of '1' held keys of up to 200).
  static constexpr char magic_value[8] = {'d', 'i', 'b', 's', 's', 'h', 'm', '2'};
  char magic[8];
  char boot_id[40];
  std::uint32_t capacity;
  std::uint32_t max_value;
  robust_mutex mutex;
  std::uint64_t last_version;
  std::int64_t undo_slot;  // the slot being changed (its old bytes are in the undo area); -1: none
};

struct shm_slot_head {
  std::uint32_t state;  // 0 never used, 1 live, 2 erased (probing goes on past it)
  std::uint32_t key_size;
  std::uint32_t value_size;
  std::uint32_t pad;
  std::uint64_t version;
  char key[key_rules::max_key_size];
};

}  // namespace detail

class shm_store {
public:
  /// Effects: opens (or creates and sets up) the segment `name`.
  /// Throws: std::system_error naming the segment (bad name, no permission,
  /// a segment of another shape or program).
  explicit shm_store(std::string name, shm_store_options opts = {}) : name_(std::move(name)), opts_(opts) {
    if (name_.empty() || name_.find('/') != std::string::npos || name_.size() > 200)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::shm_store: invalid segment name '{}' (1 to 200 bytes, no '/')", name_));
    if (opts_.capacity == 0 || opts_.max_value == 0)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::shm_store '{}': capacity and max_value must be positive", name_));
    namespace bip = boost::interprocess;
    try {
      shm_ = bip::shared_memory_object(bip::open_or_create, name_.c_str(), bip::read_write, bip::permissions(0600));
    } catch (const bip::interprocess_exception& e) {
      throw std::system_error(std::error_code{e.get_native_error(), std::system_category()},
                              fmt::format("dibs::shm_store: cannot open shared memory '{}'", name_));
    }
    // Set up under a kernel lock on the segment itself: released if we die here.
    file_mutex setup{segment_path(), {.family = lock_family::flock, .write_owner = false}};
    std::lock_guard hold{setup};
    bip::offset_t size = 0;
    shm_.get_size(size);
    const auto want = static_cast<bip::offset_t>(bytes(opts_));
    if (size == 0) shm_.truncate(want);
    else if (size != want && size < static_cast<bip::offset_t>(sizeof(detail::shm_header)))
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::shm_store: shared memory '{}' is not a dibs store", name_));
    region_ = bip::mapped_region(shm_, bip::read_write);
    head_ = static_cast<detail::shm_header*>(region_.get_address());
    const std::string boot = detail::boot_id();
    const bool ours = std::memcmp(head_->magic, detail::shm_header::magic_value, 8) == 0;
    if (ours && (head_->capacity != opts_.capacity || head_->max_value != opts_.max_value))
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::shm_store '{}': exists with capacity {} and max_value {}, "
                                          "opened with {} and {}",
                                          name_, head_->capacity, head_->max_value, opts_.capacity, opts_.max_value));
    // Not ours and of our size: new, or a setup that died half-way (it holds
    // nothing yet, since the magic is written last). Of another size: foreign.
    if (!ours && size >= static_cast<bip::offset_t>(sizeof head_->magic) && std::memcmp(head_->magic, "dibsshm", 7) == 0)
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::shm_store: shared memory '{}' was made by another version of dibs "
                                          "(layout '{}', this one reads '{}'); stop the processes that use it, then "
                                          "remove it (dibs::shm_store::remove, or rm /dev/shm/{})",
                                          name_, std::string_view(head_->magic, 8),
                                          std::string_view(detail::shm_header::magic_value, 8), name_));
    if (!ours && size != 0 && size != want)
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::shm_store: shared memory '{}' is not a dibs store", name_));
    if (!ours || std::strncmp(head_->boot_id, boot.c_str(), sizeof head_->boot_id) != 0) {
      if (!ours) {
        std::memset(region_.get_address(), 0, region_.get_size());
        head_->capacity = opts_.capacity;
        head_->max_value = opts_.max_value;
        head_->undo_slot = -1;
        // A new segment (the first, one made after a reboot, or after a
        // person removed /dev/shm/<name>) counts on from the wall clock in
        // nanoseconds, not from 1: the versions of a removed segment grew by
        // one per write from its own start, never faster than one a
        // nanosecond, so no token is handed out twice for a key (unless the
        // clock was stepped back meanwhile).
        head_->last_version = static_cast<std::uint64_t>(std::max<std::int64_t>(
            0, std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
                   .count()));
      }
      if (const int rc = head_->mutex.init(); rc != 0)
        throw std::system_error(std::error_code{rc, std::system_category()},
                                fmt::format("dibs::shm_store '{}': cannot set up its mutex", name_));
      std::memset(head_->boot_id, 0, sizeof head_->boot_id);
      std::memcpy(head_->boot_id, boot.data(), std::min(boot.size(), sizeof head_->boot_id - 1));
      // Written last; every opener reads it only under the same flock, whose
      // release and acquisition order these writes before its reads.
      std::memcpy(head_->magic, detail::shm_header::magic_value, 8);
    }
  }

  /// Effects: removes the segment `name` (open stores keep their mapping).
  static bool remove(const std::string& name) { return boost::interprocess::shared_memory_object::remove(name.c_str()); }

  std::optional<record> read(std::string_view key) const {
    validate_key(key, "dibs::shm_store::read");
    locked l{*this};
    const auto i = find(key);
    if (i < 0) return std::nullopt;
    const auto* h = slot(i);
    return record{std::string(value_of(i), h->value_size), h->version};
  }

  std::optional<dibs::version> create(std::string_view key, std::string_view value) {
    check(key, value, "dibs::shm_store::create");
    locked l{*this};
    if (find(key) >= 0) return std::nullopt;
    const auto i = free_slot(key);
    return write(i, key, value);
  }

  std::optional<dibs::version> replace(std::string_view key, dibs::version expected, std::string_view value) {
    check(key, value, "dibs::shm_store::replace");
    locked l{*this};
    const auto i = find(key);
    if (i < 0 || slot(i)->version != expected) return std::nullopt;
    return write(i, key, value);
  }

  bool erase(std::string_view key, dibs::version expected) {
    validate_key(key, "dibs::shm_store::erase");
    locked l{*this};
    const auto i = find(key);
    if (i < 0 || slot(i)->version != expected) return false;
    begin_change(i);
    slot(i)->state = 2;
    end_change();
    return true;
  }

  /// Returns: the keys of the live records that start with `prefix`.
  std::vector<std::string> keys(std::string_view prefix = {}) const {
    locked l{*this};
    std::vector<std::string> out;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(opts_.capacity); ++i) {
      const auto* h = slot(i);
      const std::string_view k(h->key, h->key_size);
      if (h->state == 1 && k.starts_with(prefix)) out.emplace_back(k);
    }
    return out;
  }

  /// The largest value this store holds (see shm_store_options::max_value).
  std::size_t max_value_size() const noexcept { return opts_.max_value; }
  const std::string& name() const noexcept { return name_; }

private:
  static std::size_t slot_bytes(const shm_store_options& o) {
    return (sizeof(detail::shm_slot_head) + o.max_value + 7) / 8 * 8;
  }
  static std::size_t bytes(const shm_store_options& o) {
    return sizeof(detail::shm_header) + slot_bytes(o) * (static_cast<std::size_t>(o.capacity) + 1);  // +1: the undo area
  }
  std::filesystem::path segment_path() const { return std::filesystem::path("/dev/shm") / name_; }

  char* base() const noexcept { return static_cast<char*>(region_.get_address()) + sizeof(detail::shm_header); }
  char* undo_area() const noexcept { return base() + slot_bytes(opts_) * opts_.capacity; }
  detail::shm_slot_head* slot(std::int64_t i) const noexcept {
    return reinterpret_cast<detail::shm_slot_head*>(base() + slot_bytes(opts_) * static_cast<std::size_t>(i));
  }
  const char* value_of(std::int64_t i) const noexcept {
    return reinterpret_cast<const char*>(slot(i)) + sizeof(detail::shm_slot_head);
  }

  void check(std::string_view key, std::string_view value, std::string_view call) const {
    validate_key(key, call);
    if (value.size() > opts_.max_value)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("{}: value for key '{}' is {} bytes; shm_store '{}' holds at most {}", call,
                                          detail::show_key(key),
                                          value.size(), name_, opts_.max_value));
  }

  // The mutex held for one operation, with the repair of a dead holder's change.
  struct locked {
    const shm_store& s;
    explicit locked(const shm_store& st) : s(st) {
      const int rc = s.head_->mutex.lock_for(s.opts_.lock_timeout);
      if (rc == ETIMEDOUT)
        throw std::system_error(make_error_code(errc::timed_out),
                                fmt::format("dibs::shm_store '{}': timed out waiting for its mutex", s.name_));
      if (rc != 0 && rc != EOWNERDEAD)
        throw std::system_error(std::error_code{rc, std::system_category()},
                                fmt::format("dibs::shm_store '{}': cannot take its mutex", s.name_));
      s.roll_back();
    }
    ~locked() { s.head_->mutex.unlock(); }
  };

  // Undoes a change a dead holder left half-done.
  void roll_back() const noexcept {
    if (head_->undo_slot < 0) return;
    std::memcpy(slot(head_->undo_slot), undo_area(), slot_bytes(opts_));
    head_->undo_slot = -1;
  }
  void begin_change(std::int64_t i) {
    std::memcpy(undo_area(), slot(i), slot_bytes(opts_));
    std::atomic_signal_fence(std::memory_order_seq_cst);
    head_->undo_slot = i;
  }
  void end_change() noexcept {
    std::atomic_signal_fence(std::memory_order_seq_cst);
    head_->undo_slot = -1;
  }

  std::uint64_t hash(std::string_view key) const noexcept {
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (char c : key) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    return h;
  }

  std::int64_t find(std::string_view key) const noexcept {
    const std::uint64_t n = opts_.capacity;
    for (std::uint64_t p = 0, i = hash(key) % n; p < n; ++p, i = (i + 1) % n) {
      const auto* h = slot(static_cast<std::int64_t>(i));
      if (h->state == 0) return -1;
      if (h->state == 1 && h->key_size == key.size() && std::memcmp(h->key, key.data(), key.size()) == 0)
        return static_cast<std::int64_t>(i);
    }
    return -1;
  }

  std::int64_t free_slot(std::string_view key) const {
    const std::uint64_t n = opts_.capacity;
    for (std::uint64_t p = 0, i = hash(key) % n; p < n; ++p, i = (i + 1) % n)
      if (slot(static_cast<std::int64_t>(i))->state != 1) return static_cast<std::int64_t>(i);
    throw std::system_error(std::error_code{ENOSPC, std::system_category()},
                            fmt::format("dibs::shm_store '{}' is full ({} slots): cannot create '{}'", name_,
                                        opts_.capacity, detail::show_key(key)));
  }

  dibs::version write(std::int64_t i, std::string_view key, std::string_view value) {
    begin_change(i);
    auto* h = slot(i);
    h->state = 1;
    h->key_size = static_cast<std::uint32_t>(key.size());
    std::memcpy(h->key, key.data(), key.size());
    h->value_size = static_cast<std::uint32_t>(value.size());
    std::memcpy(reinterpret_cast<char*>(h) + sizeof(detail::shm_slot_head), value.data(), value.size());
    h->version = ++head_->last_version;
    end_change();
    return h->version;
  }

  std::string name_;
  shm_store_options opts_;
  boost::interprocess::shared_memory_object shm_;
  boost::interprocess::mapped_region region_;
  detail::shm_header* head_ = nullptr;
};

static_assert(listable_store<shm_store>);

}  // namespace dibs
