// dibs work: runs COMMAND once per claimed item of a queue, up to -j at a
// time: dibs::worker_pool's semantics in a shell's form (include/dibs/
// worker_pool.hpp), with processes instead of handler threads. Part of
// tools/dibs.cpp, included inside its namespace after cmd_claim; the
// processes are started and reaped by command_pool (tools/platform/).
//
// One loop does everything: claims with claim_next_n as many items as
// there are free slots (no prefetch: a dibs that is not running an item
// does not hold it), starts a COMMAND for each, and waits for their ends
// and for signals on one signalfd. The COMMANDs that ended together are
// completed with one complete_n; one that failed has its item given back.
#pragma once

struct work_args {
  std::string store;
  std::vector<std::string> command;
  std::string prefix;
  int jobs = 1;
  bool wait = false;
  std::string lease = "60s";
  std::uint32_t max_attempts = 5;
  std::string retry_after;  // empty: claim_options::retry_backoff's default
  bool quiet = false;
  int exit_base = ex::completed;
};

// The idle wait of dibs work: from the first, doubling to the last.
constexpr milliseconds work_idle_first{10};
constexpr milliseconds work_idle_most{1000};

int cmd_work(work_args& a) {
  if (a.command.empty())
    fail(ex::usage, "dibs work: no COMMAND to run; write: dibs work [OPTIONS] STORE -- COMMAND [ARGS...]");
  if (a.jobs < 1 || a.jobs > 1024)
    fail(ex::usage, fmt::format("dibs work -j {}: out of range: at most N COMMANDs run at once, N from 1 to 1,024", a.jobs));
  if (a.max_attempts == 0) fail(ex::usage, "dibs work --max-attempts: must be at least 1");
  check_exit_base("dibs work", a.exit_base);
  auto outcome = [&](int code) { return code - ex::completed + a.exit_base; };
  dibs::claim_options o;
  o.lease = parse_duration("dibs work --lease", a.lease);
  o.max_attempts = a.max_attempts;
  std::optional<milliseconds> retry_after;
  if (!a.retry_after.empty()) retry_after = parse_duration("dibs work --retry-after", a.retry_after);
  // A COMMAND that cannot be run would fail every item: said before any is claimed.
  if (const auto [code, why] = check_runnable(a.command[0]); code != 0)
    fail(code, fmt::format("dibs work: cannot run '{}': {}; nothing was claimed", a.command[0], why));
  auto say = [&](const std::string& m) {
    if (!a.quiet) std::cerr << redact(m) << '\n';
  };
  command_pool pool;  // blocks the forwarded signals before marker_claim starts its renewal thread
  const auto jobs = static_cast<std::size_t>(a.jobs);
  return with_store(a.store, [&](auto& store) -> int {
    using S = std::remove_reference_t<decltype(store)>;
    using claim = typename dibs::marker_claim<S>::claim;
    dibs::marker_claim<S> claims{store, o};
    std::map<command_pool::id, claim> running;
    int stop_signal = 0;   // INT, TERM, HUP or QUIT came: claim nothing more
    int store_error = 0;   // the exit code of a store failure that stopped the claiming
    int last_failure = 0;  // the status of the last COMMAND that exited non-zero
    bool ran_any = false, lost_any = false;
    milliseconds pause = work_idle_first;

    // Gives back the item of a COMMAND that exited `code` (not 0), as dibs claim does.
    auto give_back = [&](claim& c, int code) {
      last_failure = code;
      const auto error = fmt::format("COMMAND exited {}", code);
      // Ended by the stop dibs forwarded: not the item's fault, back at once.
      const bool stopped = stop_signal != 0 && code == 128 + stop_signal;
      bool kept = true;
      try {
        kept = stopped ? c.release(error, milliseconds{0}) : retry_after ? c.release(error, *retry_after) : c.release(error);
      } catch (const std::system_error& e) {
        std::cerr << redact(fmt::format("dibs work: '{}': could not give the item back ({}); it comes back after its "
                                        "lease\n",
                                        c.key(), e.what()));
        return;
      }
      if (!kept) {
        say(fmt::format("dibs work: '{}': COMMAND exited {}; its claim (token {}) had been taken over", c.key(), code,
                        c.token()));
      } else if (c.attempts() >= a.max_attempts) {
        say(fmt::format("dibs work: '{}' failed for good: attempt {} of {} exited {}", c.key(), c.attempts(),
                        a.max_attempts, code));
      } else {
        say(fmt::format("dibs work: '{}': COMMAND exited {}; given back (attempt {} of {}){}", c.key(), code,
                        c.attempts(), a.max_attempts, stopped ? ", claimable again at once" : ""));
      }
      if (code >= outcome(ex::completed) && code <= outcome(ex::claim_lost))
        say(fmt::format("dibs work: '{}': COMMAND exited {}, a code dibs also uses for its own outcomes ({}-{}); the "
                        "item was given back; to tell the two apart, move dibs's codes with --exit-base (e.g. 200)",
                        c.key(), code, outcome(ex::completed), outcome(ex::claim_lost)));
    };

    for (;;) {
      const bool claiming = stop_signal == 0 && store_error == 0;
      bool got_any = false;
      if (claiming && running.size() < jobs) {
        std::vector<claim> got;
        try {
          got = claims.claim_next_n(jobs - running.size(), a.prefix);
        } catch (const std::system_error& e) {
          const auto [code, hint] = classify(e);
          if (dibs::is_transient(e.code())) {
            say(fmt::format("dibs work: cannot claim now ({}); trying again in {} ms", e.what(), pause.count()));
          } else {
            std::cerr << redact(fmt::format("dibs work: cannot claim: {}{}; claiming nothing more\n", e.what(),
                                            hint ? fmt::format(" ({})", hint) : ""));
            store_error = code;
            continue;
          }
        }
        for (auto& c : got) {
          std::vector<std::string> cmd = a.command;
          cmd.push_back(c.key());
          exec_args ea{cmd,
                       {{"DIBS_TOKEN", std::to_string(c.token())},
                        {"DIBS_KEY", c.key()},
                        {"DIBS_ATTEMPT", std::to_string(c.attempts())}}};
          const command_pool::id who = pool.start(ea);
          running.emplace(who, std::move(c));
          ran_any = got_any = true;
        }
      }
      if (running.empty() && (!claiming || (!a.wait && !got_any))) break;
      // Free slots: look again after a pause, from 10 ms doubling to 1 s
      // while nothing is claimable; a COMMAND's end or a signal ends it sooner.
      std::optional<milliseconds> d;
      if (claiming && running.size() < jobs) {
        if (got_any) pause = work_idle_first;
        d = pause;
        if (!got_any) pause = std::min(pause * 2, work_idle_most);
      }
      const auto ev = pool.wait(d);
      for (const int s : ev.signals) {
        if (!is_stop_signal(s) || stop_signal != 0) continue;
        stop_signal = s;
        if (!running.empty())
          say(fmt::format("dibs work: signal {}: claiming nothing more; waiting for the {} running COMMAND(s), which "
                          "got it too",
                          s, running.size()));
      }
      std::vector<claim> done;
      for (const auto& e : ev.ended) {
        auto it = running.find(e.who);
        if (it == running.end()) continue;
        claim c = std::move(it->second);
        running.erase(it);
        if (e.code == 0) done.push_back(std::move(c));
        else give_back(c, e.code);
      }
      if (done.empty()) continue;
      try {
        const std::vector<bool> ok = claims.complete_n(std::span<claim>(done), "exit 0");
        for (std::size_t i = 0; i < done.size(); ++i) {
          if (ok[i]) continue;
          lost_any = true;
          std::cerr << redact(fmt::format("dibs work: '{}': COMMAND exited 0, but the claim (token {}) was taken over "
                                          "before its completion (its lease ran out unrenewed, or dibs was judged "
                                          "gone): not completed\n",
                                          done[i].key(), done[i].token()));
        }
      } catch (const std::system_error& e) {
        const auto [code, hint] = classify(e);
        std::cerr << redact(fmt::format("dibs work: cannot record the completion of {} item(s) ({}{}); they come back "
                                        "after their lease and run again; claiming nothing more\n",
                                        done.size(), e.what(), hint ? fmt::format(": {}", hint) : ""));
        store_error = code;
      }
    }
    if (stop_signal != 0) return 128 + stop_signal;
    if (store_error != 0) return store_error;
    if (last_failure != 0) return last_failure;
    if (lost_any) return outcome(ex::claim_lost);
    if (!ran_any) {
      say(fmt::format("dibs work: nothing claimable under prefix '{}' in {}", a.prefix, a.store));
      return outcome(ex::empty);
    }
    return ex::ok;
  });
}
