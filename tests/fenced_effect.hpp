// The side effect of an item in the exactly-once tests (Linux and Windows):
// written to a journal store only with a token larger than any it has for
// the item (fencing), so a worker killed after its effect, before
// complete(), is superseded by the next claim's effect.
#pragma once

#include <dibs/store.hpp>

#include <string>

namespace dibs_test {

/// Writes an item's effect to `journal` unless the journal holds one with a
/// token at least as large (fencing), through the policies' way into a store:
/// transient failures retried, an unknown outcome read back (the token makes
/// each write recognisable). Returns: false if the token was refused as stale.
template <class Journal>
bool write_fenced_effect(Journal& journal, const std::string& k, dibs::version token) {
  const auto t = dibs::time_limit::max();
  for (;;) {
    auto r = dibs::detail::store_read(journal, k, t);
    if (!r) {
      if (dibs::detail::store_create(journal, k, std::to_string(token), t)) return true;
    } else {
      if (std::stoull(r->value) >= token) return false;
      if (dibs::detail::store_replace(journal, k, r->version, std::to_string(token), t)) return true;
    }
  }
}

}  // namespace dibs_test
