// The store issue's exactly-once test, for any store: 8 workers, 5,000 items,
// 20 SIGKILLs. The side effect of an item goes to a journal (a second store of
// the same kind) that accepts it only with a token larger than any it has for
// the item (fencing): a worker killed after its effect, before complete(), is
// superseded by the next claim's effect.
#pragma once

#include <dibs/marker_claim.hpp>

#include <catch2/catch.hpp>

#include "support.hpp"

#include <signal.h>

#include <random>
#include <string>
#include <thread>
#include <vector>

namespace dibs_test {

/// open_items() and open_journal() return a new store object (each worker
/// process opens its own after fork).
template <class OpenItems, class OpenJournal>
void check_exactly_once_under_crashes(OpenItems open_items, OpenJournal open_journal, int workers = 8, int items = 5000,
                                      int kills = 20) {
  using Store = std::remove_cvref_t<decltype(open_items())>;
  using namespace std::chrono_literals;
  // Keys as a mailbox has them: Message-IDs, with '/', '%' and '+'.
  auto key = [](int i) { return fmt::format("<item/{:04}+%{}@mail.example.com>", i, i % 7); };
  auto write_effect = [&](auto& journal, const std::string& k, dibs::version token) {
    for (;;) {
      auto r = journal.read(k);
      if (!r) {
        if (journal.create(k, std::to_string(token))) return true;
      } else {
        if (std::stoull(r->value) >= token) return false;  // a stale token: refused
        if (journal.replace(k, r->version, std::to_string(token))) return true;
      }
    }
  };
  auto start_worker = [&](int seed) {
    return spawn([&, seed]() -> int {
      auto store = open_items();
      auto journal = open_journal();
      dibs::marker_claim<Store> claims{store, {.lease = 30s, .max_attempts = 10}};
      std::mt19937 rng(static_cast<unsigned>(seed));
      const int offset = std::uniform_int_distribution<int>{0, items - 1}(rng);
      for (;;) {
        bool claimed_any = false, all_done = true;
        for (int j = 0; j < items; ++j) {
          const std::string k = key((offset + j) % items);
          if (auto c = claims.try_claim(k)) {
            claimed_any = true;
            if (!write_effect(journal, k, c->token())) return 4;
            c->complete(std::to_string(c->token()));
          } else if (claims.status(k).state != dibs::claim_state::completed) {
            all_done = false;
          }
        }
        if (all_done) return 0;
        if (!claimed_any) std::this_thread::sleep_for(5ms);
      }
    });
  };
  std::vector<pid_t> pids;
  int seed = 0;
  for (int i = 0; i < workers; ++i) pids.push_back(start_worker(seed++));
  std::mt19937 rng(99);
  for (int k = 0; k < kills; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds{std::uniform_int_distribution<int>{20, 150}(rng)});
    const std::size_t victim = std::uniform_int_distribution<std::size_t>{0, pids.size() - 1}(rng);
    ::kill(pids[victim], SIGKILL);
    wait_exit(pids[victim]);
    pids[victim] = start_worker(seed++);
  }
  int failed = 0;
  for (pid_t p : pids) failed += wait_exit(p) != 0;
  CHECK(failed == 0);

  auto store = open_items();
  auto journal = open_journal();
  dibs::marker_claim<Store> claims{store};
  int completed = 0, effects_match = 0, retried = 0;
  for (int i = 0; i < items; ++i) {
    const auto s = claims.status(key(i));
    if (s.state == dibs::claim_state::completed) ++completed;
    if (s.attempts > 1) ++retried;
    const auto e = journal.read(key(i));
    if (e && e->value == s.result) ++effects_match;
  }
  INFO("items retried after a kill: " << retried);
  CHECK(completed == items);
  CHECK(effects_match == items);  // each item's effect is in the journal once, from the claim that completed it
}

}  // namespace dibs_test
