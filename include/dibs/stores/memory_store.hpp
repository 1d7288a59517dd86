// dibs/stores/memory_store.hpp: the reference model of dibs::shared_store, in one
// process, thread-safe.
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <dibs/store.hpp>

namespace dibs {

/// A shared_store in this process's memory. Versions come from one counter
/// for the whole store, so they grow per key across erase and re-create.
class memory_store {
public:
  std::optional<record> read(std::string_view key) const {
    validate_key(key, "dibs::memory_store::read");
    std::lock_guard lock{m_};
    if (auto it = records_.find(key); it != records_.end()) return it->second;
    return std::nullopt;
  }

  std::optional<dibs::version> create(std::string_view key, std::string_view value) {
    validate_key(key, "dibs::memory_store::create");
    validate_value(key, value);
    std::lock_guard lock{m_};
    if (records_.find(key) != records_.end()) return std::nullopt;
    const dibs::version v = ++last_;
    records_.emplace(std::string(key), record{std::string(value), v});
    return v;
  }

  std::optional<dibs::version> replace(std::string_view key, dibs::version expected, std::string_view value) {
    validate_key(key, "dibs::memory_store::replace");
    validate_value(key, value);
    std::lock_guard lock{m_};
    auto it = records_.find(key);
    if (it == records_.end() || it->second.version != expected) return std::nullopt;
    it->second = record{std::string(value), ++last_};
    return it->second.version;
  }

  bool erase(std::string_view key, dibs::version expected) {
    validate_key(key, "dibs::memory_store::erase");
    std::lock_guard lock{m_};
    auto it = records_.find(key);
    if (it == records_.end() || it->second.version != expected) return false;
    records_.erase(it);
    return true;
  }

  /// Returns: the keys of the live records that start with `prefix`.
  std::vector<std::string> keys(std::string_view prefix = {}) const {
    std::lock_guard lock{m_};
    std::vector<std::string> out;
    for (auto it = records_.lower_bound(prefix); it != records_.end() && it->first.starts_with(prefix); ++it)
      out.push_back(it->first);
    return out;
  }

private:
  mutable std::mutex m_;
  std::map<std::string, record, std::less<>> records_;
  dibs::version last_ = 0;
};

static_assert(listable_store<memory_store>);

}  // namespace dibs
