// Shared by the sqlite_store claim benchmarks: the mailbox schema, the rows,
// and the hand-written claim loop that marker_claim<sqlite_store> is compared
// with (two autocommit statements per item on the same schema, WAL,
// synchronous=NORMAL).
#pragma once

#include <dibs/sqlite/connection.hpp>
#include <dibs/stores/sqlite_store.hpp>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>

#include <fmt/format.h>

namespace bench {

inline std::string key_of(long i) { return fmt::format("item-{:06d}", i); }

/// Effects: removes the database at `path` with its WAL and shared-memory files.
inline void remove_database(const std::filesystem::path& path) {
  std::filesystem::remove(path);
  std::filesystem::remove(path.string() + "-wal");
  std::filesystem::remove(path.string() + "-shm");
}

/// Removes the database at `path` when it goes out of scope: declared before
/// the connections to it, it outlives them.
struct removed_at_exit {
  std::filesystem::path path;
  ~removed_at_exit() { remove_database(path); }
};

/// Effects: creates `path` with a mailbox table holding `items` unclaimed rows.
inline void make_mailbox(const std::filesystem::path& path, long items) {
  remove_database(path);
  dibs::sqlite::connection db{path};
  db.exec("CREATE TABLE mailbox (key TEXT PRIMARY KEY NOT NULL, value BLOB, version INTEGER NOT NULL DEFAULT 0, "
          "body TEXT)");
  db.begin();
  auto ins = db.prepare("INSERT INTO mailbox (key, body) VALUES (?1, ?2)");
  for (long i = 0; i < items; ++i) {
    ins.bind(1, key_of(i)).bind(2, fmt::format("order {} apples", i % 17));
    (void)ins.step();
  }
  db.commit();
}

/// The same work by hand: claim = one UPDATE that takes an unclaimed row,
/// complete = one UPDATE guarded by the version the claim wrote. Busy is
/// retried like the store does (jittered backoff).
class hand_claims {
public:
  /// `owner` and `done` are the values the claim and the completion write:
  /// by default a bare flag ("processing pid N", "completed"); given
  /// records as long as marker_claim's, the loop is the floor of what
  /// marker_claim can cost with the same two statements.
  explicit hand_claims(const std::filesystem::path& path, std::string owner = fmt::format("processing pid {}", ::getpid()),
                       std::string done = "completed")
      : db_(path),
        claim_(db_, "UPDATE mailbox SET value = ?2, version = version + 1 WHERE key = ?1 AND value IS NULL "
                    "RETURNING version"),
        complete_(db_, "UPDATE mailbox SET value = ?3, version = version + 1 WHERE key = ?1 AND version = ?2"),
        owner_(std::move(owner)),
        done_(std::move(done)) {}

  /// Returns: true if this call claimed and completed `key`.
  bool claim_and_complete(const std::string& key) {
    const auto v = dibs::retry(busy_, [&]() -> std::int64_t {
      claim_.bind(1, key).bind_blob(2, owner_);
      if (!claim_.step()) return 0;
      const auto got = claim_.column_int64(0);
      while (claim_.step()) {
      }
      return got;
    });
    if (v == 0) return false;
    dibs::retry(busy_, [&] {
      complete_.bind(1, key).bind(2, v).bind(3, done_);
      (void)complete_.step();
    });
    return db_.changes() == 1;
  }

private:
  dibs::sqlite::connection db_;
  dibs::sqlite::statement claim_, complete_;
  std::string owner_, done_;
  dibs::retry_policy busy_ = dibs::sqlite_store_options{}.busy;
};

}  // namespace bench
