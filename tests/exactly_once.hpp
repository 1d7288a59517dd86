// The store issue's exactly-once test, for any store: 8 workers, 5,000 items,
// 20 SIGKILLs. The side effect of an item goes to a journal (a second store of
// the same kind) that accepts it only with a token larger than any it has for
// the item (fencing): a worker killed after its effect, before complete(), is
// superseded by the next claim's effect.
#pragma once

#include <dibs/marker_claim.hpp>

#include <catch2/catch.hpp>

#include "fenced_effect.hpp"
#include "support.hpp"

#include <signal.h>
#include <sys/mman.h>

#include <atomic>
#include <functional>
#include <random>
#include <type_traits>
#include <string>
#include <thread>
#include <vector>

namespace dibs_test {

/// Effects: `kills` times, after 20-150 ms, SIGKILLs a random one of `pids`
/// and puts start() in its place (seeded: the same schedule every run).
/// Returns: how many of the kills found their victim running (it ended by
/// the SIGKILL, not before it on its own): the callers keep their workers
/// running until the kills are over, so all of them should.
template <class Start>
int kill_and_replace(std::vector<pid_t>& pids, int kills, unsigned seed, Start start) {
  std::mt19937 rng(seed);
  int landed = 0;
  for (int k = 0; k < kills; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds{std::uniform_int_distribution<int>{20, 150}(rng)});
    const std::size_t victim = std::uniform_int_distribution<std::size_t>{0, pids.size() - 1}(rng);
    ::kill(pids[victim], SIGKILL);
    landed += wait_exit(pids[victim]) == 128 + SIGKILL;
    pids[victim] = start();
  }
  return landed;
}

/// open_items() and open_journal() return a new store object (each worker
/// process opens its own after fork).
/// `during(done)`, if given, runs in the parent beside the workers until
/// done() (e.g. a thread that crashes and restarts a server): workers take
/// transient errors as a real worker does (a pause, then on with the loop).
/// The last tenth of the items is held back (the workers skip them) until
/// the kills are over and `during` has returned, so that both land while
/// work remains however fast the machine is: done() is false until then.
inline void nothing_during(const std::function<bool()>&) {}

template <class OpenItems, class OpenJournal, class During = decltype(&nothing_during)>
void check_exactly_once_under_crashes(OpenItems open_items, OpenJournal open_journal, int workers = 8, int items = 5000,
                                      int kills = 20, During during = &nothing_during) {
  using Store = std::remove_cvref_t<decltype(open_items())>;
  using namespace std::chrono_literals;
  // Keys as a mailbox has them: Message-IDs, with '/', '%' and '+'.
  auto key = [](int i) { return fmt::format("<item/{:04}+%{}@mail.example.com>", i, i % 7); };
  const int held_back = items / 10;
  temp_dir flags;
  const auto gate = flags.path / "open";
  auto start_worker = [&](int seed) {
    return spawn([&, seed]() -> int {
      // Opened again while the store is away for a moment (a server restarting).
      const auto forever = dibs::time_limit::max();
      auto store = dibs::detail::retry_transient(forever, open_items);
      auto journal = dibs::detail::retry_transient(forever, open_journal);
      dibs::marker_claim<Store> claims{store, {.lease = 30s, .max_attempts = 10}};
      std::mt19937 rng(static_cast<unsigned>(seed));
      const int offset = std::uniform_int_distribution<int>{0, items - 1}(rng);
      for (;;) {
        bool claimed_any = false, all_done = true;
        const bool open = std::filesystem::exists(gate);
        for (int j = 0; j < items; ++j) {
          const int i = (offset + j) % items;
          if (!open && i >= items - held_back) {
            all_done = false;
            continue;
          }
          const std::string k = key(i);
          try {
            if (auto c = claims.try_claim(k)) {
              claimed_any = true;
              if (!write_fenced_effect(journal, k, c->token())) return 4;
              c->complete(std::to_string(c->token()));
            } else if (claims.status(k).state != dibs::claim_state::completed) {
              all_done = false;
            }
          } catch (const std::system_error& e) {
            // The store is away for a moment: on with the loop. A claim
            // whose write was lost and could not be read back in time may
            // be held in this worker's name: it comes back after its lease.
            if (!dibs::is_transient(e.code()) && e.code() != dibs::errc::outcome_unknown) throw;
            all_done = false;
            std::this_thread::sleep_for(20ms);
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
  // A thread beside the workers only when there is something to do: a
  // worker started again (after a kill) is forked from this process, and
  // under TSan a child of a process with threads may not start threads.
  std::atomic<bool> finished{false};
  std::thread beside;
  if constexpr (!std::is_same_v<During, decltype(&nothing_during)>)
    beside = std::thread([&] { during([&] { return finished.load(); }); });
  const int landed = kill_and_replace(pids, kills, 99, [&] { return start_worker(seed++); });
  if (beside.joinable()) beside.join();
  spit(gate, "");
  int failed = 0;
  for (pid_t p : pids) failed += wait_exit(p) != 0;
  finished = true;
  CHECK(failed == 0);
  CHECK(landed == kills);  // each kill ended a running worker, mid-run

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

namespace dibs_test {

/// Returns: how many items under `prefix` are completed, once all `items`
/// are or `within` has passed (the workers' last items come back after
/// the kills through sweeps and leases).
template <class Claims>
int completed_within(Claims& claims, std::string_view prefix, int items, std::chrono::seconds within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  int completed = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    completed = 0;
    for (const auto& item : claims.list(prefix)) completed += item.status.state == dibs::claim_state::completed;
    if (completed == items) break;
    std::this_thread::sleep_for(std::chrono::milliseconds{200});
  }
  return completed;
}

/// The same invariant for a queue: the parent offers `items` items, workers
/// take them with claim_next (they do not know the keys), `kills` workers
/// are SIGKILLed on the way and replaced; at the end every item is completed
/// once and its effect is the completing claim's. `lease`: short, so that
/// items of killed workers come back through claim_next's sweeps soon.
template <class OpenItems, class OpenJournal>
void check_claim_next_exactly_once(OpenItems open_items, OpenJournal open_journal, int workers, int items, int kills,
                                   std::chrono::milliseconds lease) {
  using Store = std::remove_cvref_t<decltype(open_items())>;
  using namespace std::chrono_literals;
  auto key = [](int i) { return fmt::format("q/<job/{:05}@queue>", i); };
  {
    auto store = open_items();
    dibs::marker_claim<Store> claims{store};
    for (int i = 0; i < items; ++i) REQUIRE(claims.offer(key(i)));
    CHECK_FALSE(claims.offer(key(0)));  // offered once
  }
  temp_dir flags;
  const auto stop_flag = flags.path / "stop";
  auto start_worker = [&](int seed) {
    return spawn([&, seed]() -> int {
      const auto forever = dibs::time_limit::max();
      auto store = dibs::detail::retry_transient(forever, open_items);
      auto journal = dibs::detail::retry_transient(forever, open_journal);
      dibs::marker_claim<Store> claims{store, {.lease = lease, .max_attempts = 20}};
      std::mt19937 rng(static_cast<unsigned>(seed));
      while (!std::filesystem::exists(stop_flag)) {
        try {
          auto c = claims.claim_next("q/");
          if (!c) {
            std::this_thread::sleep_for(std::chrono::milliseconds{std::uniform_int_distribution<int>{2, 10}(rng)});
            continue;
          }
          if (!write_fenced_effect(journal, c->key(), c->token())) return 4;  // a stale claim: must never happen
          c->complete(std::to_string(c->token()));
        } catch (const std::system_error& e) {
          if (!dibs::is_transient(e.code()) && e.code() != dibs::errc::outcome_unknown) throw;
          std::this_thread::sleep_for(20ms);
        }
      }
      return 0;
    });
  };
  std::vector<pid_t> pids;
  int seed = 1000;
  for (int i = 0; i < workers; ++i) pids.push_back(start_worker(seed++));
  const int landed = kill_and_replace(pids, kills, 7, [&] { return start_worker(seed++); });
  CHECK(landed == kills);  // each kill ended a running worker (they run until stop_flag)
  auto store = open_items();
  dibs::marker_claim<Store> claims{store};
  const int completed = completed_within(claims, "q/", items, 120s);
  spit(stop_flag, "");
  int failed = 0;
  for (pid_t p : pids) failed += wait_exit(p) != 0;
  CHECK(failed == 0);
  CHECK(completed == items);
  auto journal = open_journal();
  int effects_match = 0, retried = 0;
  for (int i = 0; i < items; ++i) {
    const auto s = claims.status(key(i));
    if (s.attempts > 1) ++retried;
    const auto e = journal.read(key(i));
    if (e && e->value == s.result) ++effects_match;
  }
  INFO("items claimed again after a kill: " << retried);
  CHECK(effects_match == items);
  CHECK_FALSE(claims.claim_next("q/"));  // nothing is left to take
}

}  // namespace dibs_test

#include <dibs/worker_pool.hpp>

namespace dibs_test {

/// Returns: the fencing token a claim record names ("token N"), 0 if none.
inline dibs::version record_token(const std::optional<dibs::record>& r) {
  if (!r) return 0;
  return dibs::detail::number_field<dibs::version>(r->value, "token").value_or(0);
}

/// The queue invariant for dibs::worker_pool: the parent offers `items`
/// items with offer_n, `workers` processes each run a pool (4 handler
/// threads, prefetch 8) whose handler writes the item's fenced effect, and
/// `kills` of them are SIGKILLed on the way and replaced: the k-th kill
/// comes once k/(kills + 1) of the items have had their effect (counted in
/// memory the processes share), so every kill lands while the pools work,
/// with items prefetched, running, and handled but not yet completed,
/// however fast the machine is. At the end every item is completed once and
/// its effect is the completing claim's (the journal's token is the
/// completed record's).
/// `during(done)`, if given, runs in the parent beside the workers (a
/// thread that kills and restarts a server, or ends sessions, say) until it
/// returns; done() is true once every item has had its effect.
template <class OpenItems, class OpenJournal, class During = decltype(&nothing_during)>
void check_pool_exactly_once(OpenItems open_items, OpenJournal open_journal, int workers, int items, int kills,
                             std::chrono::milliseconds lease, During during = &nothing_during) {
  using Store = std::remove_cvref_t<decltype(open_items())>;
  using namespace std::chrono_literals;
  auto key = [](int i) { return fmt::format("p/<job/{:05}@pool>", i); };
  {
    auto store = open_items();
    dibs::marker_claim<Store> claims{store};
    std::vector<std::string> keys;
    for (int i = 0; i < items; ++i) keys.push_back(key(i));
    for (std::size_t at = 0; at < keys.size(); at += 1000)
      REQUIRE(claims.offer_n(std::span(keys).subspan(at, std::min<std::size_t>(1000, keys.size() - at))) ==
              std::min<std::size_t>(1000, keys.size() - at));
  }
  void* mem = ::mmap(nullptr, sizeof(std::atomic<long>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(mem != MAP_FAILED);
  auto* effects = new (mem) std::atomic<long>{0};
  temp_dir flags;
  const auto stop_flag = flags.path / "stop";
  auto start_worker = [&](int) {
    return spawn([&]() -> int {
      const auto forever = dibs::time_limit::max();
      auto store = dibs::detail::retry_transient(forever, open_items);
      auto journal = dibs::detail::retry_transient(forever, open_journal);
      std::mutex journal_m;  // one journal connection, four handler threads
      dibs::marker_claim<Store> claims{store, {.lease = lease, .max_attempts = 20}};
      std::atomic<bool> stale{false};
      dibs::worker_pool pool{claims,
                             [&](const auto& c) {
                               std::lock_guard g{journal_m};
                               if (!write_fenced_effect(journal, c.key(), c.token())) stale = true;
                               ++*effects;
                             },
                             {.concurrency = 4, .prefetch = 8, .prefix = "p/", .idle_wait = 20ms,
                              .on_error = [](const std::exception&) {}}};
      std::stop_source stop;
      std::thread watch{[&] {
        while (!std::filesystem::exists(stop_flag)) std::this_thread::sleep_for(10ms);
        stop.request_stop();
      }};
      (void)pool.run(stop.get_token());
      watch.join();
      return stale ? 4 : 0;  // 4: a stale claim's effect, which must never happen
    });
  };
  std::vector<pid_t> pids;
  int seed = 2000;
  for (int i = 0; i < workers; ++i) pids.push_back(start_worker(seed++));
  std::thread beside;
  if constexpr (!std::is_same_v<During, decltype(&nothing_during)>)
    beside = std::thread([&] { during([&] { return effects->load() >= items; }); });
  std::mt19937 rng(11);
  int landed = 0;
  const auto give_up = std::chrono::steady_clock::now() + 120s;
  for (int k = 1; k <= kills; ++k) {
    const long due = static_cast<long>(items) * k / (kills + 2);
    while (effects->load() < due && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(1ms);
    const std::size_t victim = std::uniform_int_distribution<std::size_t>{0, pids.size() - 1}(rng);
    ::kill(pids[victim], SIGKILL);
    landed += wait_exit(pids[victim]) == 128 + SIGKILL;
    pids[victim] = start_worker(seed++);
  }
  if (beside.joinable()) beside.join();
  CHECK(landed == kills);  // each kill ended a running worker (they run until stop_flag)
  auto store = open_items();
  dibs::marker_claim<Store> claims{store};
  const int completed = completed_within(claims, "p/", items, 120s);
  spit(stop_flag, "");
  int failed = 0;
  for (pid_t p : pids) failed += wait_exit(p) != 0;
  ::munmap(mem, sizeof(std::atomic<long>));
  CHECK(failed == 0);
  CHECK(completed == items);
  auto journal = open_journal();
  int effects_match = 0, retried = 0;
  for (int i = 0; i < items; ++i) {
    if (claims.status(key(i)).attempts > 1) ++retried;
    const auto e = journal.read(key(i));
    if (e && std::stoull(e->value) == record_token(store.read(key(i)))) ++effects_match;
  }
  INFO("items claimed again after a kill: " << retried);
  CHECK(effects_match == items);
  CHECK(retried > 0);  // the kills came while the pools held items (no handler fails here)
  CHECK_FALSE(claims.claim_next("p/"));
}

}  // namespace dibs_test
