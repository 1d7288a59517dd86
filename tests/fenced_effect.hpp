// The side effect of an item in the exactly-once tests (Linux and Windows):
// written to a journal store only with a token larger than any it has for
// the item (fencing), so a worker killed after its effect, before
// complete(), is superseded by the next claim's effect.
#pragma once

#include <dibs/marker_claim.hpp>
#include <dibs/store.hpp>

#include <chrono>
#include <random>
#include <string>
#include <thread>

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

/// The claiming worker of the exactly-once tests: goes through the `items`
/// keys `key_of(0..items-1)` from a random offset (so that workers meet),
/// claims each it can, writes its fenced effect to `journal`, holds it
/// `hold` (so that kills find claims held), completes it; waits `idle`
/// after a round that claimed nothing. Returns: 0 once every item is
/// completed; 4 if an effect's token was refused as stale.
template <class Claims, class Journal, class KeyOf>
int claim_every_item(Claims& claims, Journal& journal, int items, KeyOf key_of, unsigned seed,
                     std::chrono::milliseconds hold, std::chrono::milliseconds idle) {
  std::mt19937 rng(seed);
  const int offset = std::uniform_int_distribution<int>{0, items - 1}(rng);
  for (;;) {
    bool claimed_any = false, all_done = true;
    for (int j = 0; j < items; ++j) {
      const std::string k = key_of((offset + j) % items);
      if (auto c = claims.try_claim(k)) {
        claimed_any = true;
        if (!write_fenced_effect(journal, k, c->token())) return 4;
        if (hold.count() > 0) std::this_thread::sleep_for(hold);
        c->complete(std::to_string(c->token()));
      } else if (claims.status(k).state != dibs::claim_state::completed) {
        all_done = false;
      }
    }
    if (all_done) return 0;
    if (!claimed_any) std::this_thread::sleep_for(idle);
  }
}

}  // namespace dibs_test
