// IMAP benchmarks of dibs against the same work written by hand over a bare
// dibs::imap::session, P processes at once (benchmarks/run_imap_benchmarks.sh
// runs them on a server of scripts/imap.sh; docs/BENCHMARKS.md has the
// figures). Every run gets folders of its own, deleted at the end.
//
//   imap_claims --mode dibs-own     --procs P --items M [--complete]
//       each process claims its own M/P fresh keys: marker_claim<imap_store>
//       try_claim (+ complete() with --complete). The claims are kept (not
//       given back) until the clock has stopped.
//   imap_claims --mode floor-own    --procs P --items M [--complete]
//       the floor of that protocol by hand: per claim one APPEND of a small
//       claim message and one UID FETCH of it by its APPENDUID (--complete:
//       a second APPEND and FETCH, the "completed" message)
//   imap_claims --mode dibs-shared  --procs P --items M
//       all processes try_claim the same M keys in the same order; each key
//       is won by exactly one (checked, and a store opened afterwards must
//       see all M records)
//   imap_claims --mode floor-shared --procs P --items M
//       the same race by hand: APPEND, then UID FETCH <last seen + 1>:<own
//       UID> of the claim header; the lowest UID of a key wins. A key
//       already seen claimed in an earlier fetch is skipped without a round
//       trip. Checked the same way.
//   imap_claims --mode dibs-mailbox  --procs P --items M
//       M messages APPENDed to a mailbox beforehand (not timed); P workers
//       run dibs::imap_mailbox next() + complete() until all M are handled
//       (--no-processing: with processing_keyword empty, no $Processing)
//   imap_claims --mode ops --items M
//       one process, the round trips a claim is made of, each timed M times
//       (median ms): NOOP, UID FETCH <next UID>:* when nothing is new, APPEND,
//       UID FETCH of one UID, keyword STOREs, an APPEND with a STORE sent
//       on a second session at once, and imap_store read() of an absent key
//       and create() of a fresh one
//   imap_claims --mode floor-mailbox --procs P --items M
//       the same job by hand, decided the same way (APPEND order): per
//       message an APPEND of a claim to a claims folder + UID FETCH <last
//       seen + 1>:<own UID> to see whether it won, then (the winner) UID
//       FETCH of the message's body and UID STORE +FLAGS ($Completed).
//       No $Processing, no completion record, no recovery of dead workers.
//       --complete: the winner also APPENDs a completion record to the
//       claims folder (and reads it back) before the STORE: the durable
//       writes of a design whose "done" is a record, not a keyword anyone
//       can clear (what imap_mailbox writes, less $Processing)
//
// Items/s counts won claims (each key once) per second, from the start gate
// to the last process's last claim. The server: DIBS_IMAP_* (scripts/imap.sh
// start DIR prints them). Prints one JSON object.
#include <dibs/imap/client.hpp>
#include <dibs/imap/mailbox.hpp>
#include <dibs/imap/store.hpp>
#include <dibs/marker_claim.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "procs.hpp"

namespace {

using dibs_bench::mono_ns;

constexpr long max_items = 100'000;

struct shared {
  std::atomic<long> handled{0};  // mailbox: messages completed so far
  std::atomic<long> won[64];
  std::atomic<std::int64_t> append_ns{0}, fetch_ns{0}, claim_ns{0}, work_ns{0};
  std::atomic<long> appends{0}, fetches{0}, claims{0}, works{0}, refetches{0};
  std::atomic<int> winners[max_items];
};

std::string key_of(long i) { return fmt::format("job-{:08}", i); }

std::uint32_t appenduid(const dibs::imap::reply& r) {
  const auto f = dibs::imap::parse(r.code);
  if (!r.ok() || f.size() < 3 || !f[0].is("APPENDUID") || !f[2].number())
    throw std::runtime_error(fmt::format("APPEND: {} [{}] {}", r.status, r.code, r.text));
  return static_cast<std::uint32_t>(*f[2].number());
}

// The hand-written side: one session with `folder` selected.
struct hand {
  dibs::imap::session s{dibs::imap::options::from_env()};
  std::string folder;
  shared* sh;
  std::mt19937_64 rng{std::random_device{}()};

  hand(std::string f, shared* h) : folder(std::move(f)), sh(h) {
    s.check(s.run(fmt::format("SELECT {}", dibs::imap::quote(folder))), "SELECT");
  }

  // A small claim message, as a hand-written client would write it.
  std::uint32_t append(std::string_view key, std::string_view what) {
    const auto text = fmt::format(
        "From: bench <bench@dibs.invalid>\r\nSubject: claim {}\r\nMessage-ID: <{:016x}@dibs.invalid>\r\n"
        "X-Claim: {} {} {}\r\n\r\n{} {} by pid {}\r\n",
        key, rng(), key, what, ::getpid(), key, what, ::getpid());
    const auto t0 = mono_ns();
    const auto r = s.run(fmt::format("APPEND {} (\\Seen) {{{}+}}\r\n{}", dibs::imap::quote(folder), text.size(), text));
    sh->append_ns += mono_ns() - t0;
    ++sh->appends;
    return appenduid(r);
  }

  // UID FETCH of `set`; the (UID, X-Claim key) of each message it returned.
  std::vector<std::pair<std::uint32_t, std::string>> fetch(const std::string& set) {
    const auto t0 = mono_ns();
    const auto r = s.run(fmt::format("UID FETCH {} (UID BODY.PEEK[HEADER.FIELDS (X-Claim)])", set));
    sh->fetch_ns += mono_ns() - t0;
    ++sh->fetches;
    s.check(r, "UID FETCH");
    std::vector<std::pair<std::uint32_t, std::string>> out;
    for (const auto& line : r.untagged) {
      const auto v = dibs::imap::parse(line);
      if (v.size() < 3 || !v[1].is("FETCH") || v[2].kind != dibs::imap::value::kind::list) continue;
      std::uint32_t uid = 0;
      std::string key;
      const auto& it = v[2].items;
      for (std::size_t i = 0; i + 1 < it.size(); i += 2) {
        if (it[i].is("UID")) uid = static_cast<std::uint32_t>(it[i + 1].number().value_or(0));
        else if (dibs::imap::detail::istarts_with(it[i].text, "BODY[")) {
          const auto& h = it[i + 1].text;  // "X-Claim: <key> <what> <pid>\r\n\r\n"
          if (const auto c = h.find(": "); c != std::string::npos) key = h.substr(c + 2, h.find(' ', c + 2) - c - 2);
        }
      }
      if (uid) out.emplace_back(uid, key);
    }
    return out;
  }

  // APPEND + UID FETCH of the message just appended (NOOP and again if the
  // session does not show it yet: counted in refetches).
  void append_and_read(std::string_view key, std::string_view what) {
    const auto uid = append(key, what);
    for (int i = 0; fetch(std::to_string(uid)).empty(); ++i) {
      if (i == 5) throw std::runtime_error(fmt::format("UID {} not visible after APPEND", uid));
      ++sh->refetches;
      s.run("NOOP");
    }
  }

  // The race: APPEND, then everything new up to the own UID. Returns: true
  // if the own message is the key's lowest UID.
  std::uint32_t last = 0;
  std::map<std::string, std::uint32_t> first;  // key -> lowest UID seen
  bool claimed(const std::string& key) const { return first.count(key) != 0; }
  bool race(const std::string& key) {
    const auto uid = append(key, "claim");
    for (int i = 0;; ++i) {
      const auto from = last + 1;
      bool mine = false;
      for (const auto& [u, k] : fetch(fmt::format("{}:{}", from, uid))) {
        if (u < from || u > uid) continue;  // "n:m" also returns the highest UID if none is in range
        last = std::max(last, u);
        mine = mine || u == uid;
        auto [it, fresh] = first.try_emplace(k, u);
        if (!fresh && u < it->second) it->second = u;
      }
      if (mine) break;
      if (i == 5) throw std::runtime_error(fmt::format("UID {} not visible after APPEND", uid));
      ++sh->refetches;
      s.run("NOOP");
    }
    return first.at(key) == uid;
  }
};

double median_ms(const std::vector<std::int64_t>& v) { return dibs_bench::median(v) / 1e6; }

int ops(long n) try {
  auto* sh = new shared{};
  const auto server = dibs::imap::options::from_env();
  const std::string folder = fmt::format("bench-ops-{}", ::getpid());
  dibs::imap::session admin{server};
  admin.check(admin.run(fmt::format("CREATE {}", dibs::imap::quote(folder))), "CREATE");
  std::map<std::string, std::vector<std::int64_t>> t;
  auto timed = [&](const char* what, auto f) {
    const auto t0 = mono_ns();
    f();
    t[what].push_back(mono_ns() - t0);
  };
  {
    hand h{folder, sh};
    hand other{folder, sh};
    std::uint32_t uid = 0;
    for (long i = 0; i < n; ++i) {
      timed("NOOP", [&] { h.s.run("NOOP"); });
      timed("UID FETCH <next>:* (nothing new)", [&] { h.s.run(fmt::format("UID FETCH {}:* (UID FLAGS)", uid + 1)); });
      timed("APPEND (small message)", [&] { uid = h.append(key_of(i), "claim"); });
      timed("UID FETCH <uid> (its header)", [&] { h.fetch(std::to_string(uid)); });
      // The keyword writes a message's view is made of (each fsync'd on a
      // server with mail_fsync=always), alone and pipelined.
      timed("UID STORE +FLAGS (one keyword)", [&] { h.s.run(fmt::format("UID STORE {} +FLAGS.SILENT ($A)", uid)); });
      timed("UID STORE -FLAGS, +FLAGS (pipelined)", [&] {
        h.s.run(std::vector<std::string>{fmt::format("UID STORE {} -FLAGS.SILENT ($A)", uid),
                                         fmt::format("UID STORE {} +FLAGS.SILENT ($B)", uid)});
      });
      timed("UID STORE -FLAGS of a keyword not set", [&] { h.s.run(fmt::format("UID STORE {} -FLAGS.SILENT ($C)", uid)); });
      // Whether a keyword write on one connection can hide behind an
      // APPEND on another (as imap_mailbox sends its keywords): the STORE
      // is sent on the second session, the APPEND made on the first, then
      // the STORE's reply read. About the APPEND's time alone if the server
      // and disk write them side by side, about the sum if their flushes
      // take turns.
      timed("APPEND with a UID STORE +FLAGS sent on another session", [&] {
        other.s.send_ahead({fmt::format("UID STORE {} +FLAGS.SILENT ($D)", uid)});
        uid = h.append(key_of(i), "claim");
        other.s.check(other.s.finish().at(0), "UID STORE");
      });
    }
  }
  {
    dibs::imap_store store{server, {.folder = folder}};
    for (long i = 0; i < n; ++i) {
      timed("imap_store read (absent key)", [&] { (void)store.read(fmt::format("absent-{}", i)); });
      timed("imap_store create (fresh key)", [&] { (void)store.create(fmt::format("fresh-{}", i), "dibs-claim 1\nstate processing\n"); });
    }
  }
  admin.run(fmt::format("DELETE {}", dibs::imap::quote(folder)));
  std::string out;
  for (const auto& [what, v] : t) out += fmt::format("{}\"{}\": {:.3f}", out.empty() ? "" : ", ", what, median_ms(v));
  std::printf("{\"mode\": \"ops\", \"items\": %ld, \"median_ms\": {%s}}\n", n, out.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "imap_claims: %s\n", e.what());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "dibs-own";
  int procs = 1;
  long items = 200;
  bool complete = false, no_processing = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--complete") complete = true;
    else if (a == "--no-processing") no_processing = true;
    else if (a == "--mode" && i + 1 < argc) mode = argv[++i];
    else if (a == "--procs" && i + 1 < argc) procs = std::atoi(argv[++i]);
    else if (a == "--items" && i + 1 < argc) items = std::atol(argv[++i]);
    else {
      std::fprintf(stderr,
                   "usage: imap_claims --mode <dibs|floor>-<own|shared|mailbox> [--procs P] [--items M] [--complete] "
                   "[--no-processing]\n");
      return 2;
    }
  }
  if (mode == "ops") return ops(items);
  const auto dash = mode.find('-');
  const std::string way = mode.substr(0, dash), bench = dash == std::string::npos ? "" : mode.substr(dash + 1);
  if ((way != "dibs" && way != "floor") || (bench != "own" && bench != "shared" && bench != "mailbox") ||
      (complete && bench != "own" && mode != "floor-mailbox") ||
      (no_processing && (way != "dibs" || bench != "mailbox")) || procs < 1 || procs > 64 || items < 1 ||
      items > max_items) {
    std::fprintf(stderr, "imap_claims: bad arguments (try without any for the usage)\n");
    return 2;
  }
  try {
    auto* sh = dibs_bench::shared_new<shared>();
    const auto server = dibs::imap::options::from_env();
    const std::string folder = fmt::format("bench-{}-{}", mode, ::getpid());
    const std::string inbox = folder + "-inbox";
    dibs::imap::session admin{server};
    admin.check(admin.run(fmt::format("CREATE {}", dibs::imap::quote(folder))), "CREATE");
    if (bench == "mailbox") {
      // The mail, delivered beforehand: APPENDs pipelined 50 at a time.
      admin.check(admin.run(fmt::format("CREATE {}", dibs::imap::quote(inbox))), "CREATE");
      std::vector<std::string> batch;
      for (long i = 0; i < items; ++i) {
        const auto text = fmt::format(
            "From: shop <orders@shop.invalid>\r\nTo: orders@dibs.invalid\r\nSubject: order {}\r\n"
            "Message-ID: <order-{}-{}@shop.invalid>\r\n\r\nPlease ship order {} (2 items).\r\n",
            i, i, ::getpid(), i);
        batch.push_back(fmt::format("APPEND {} {{{}+}}\r\n{}", dibs::imap::quote(inbox), text.size(), text));
        if (batch.size() == 50 || i + 1 == items) {
          for (const auto& r : admin.run(batch)) admin.check(r, "delivering the mail");
          batch.clear();
        }
      }
    }
    const dibs::claim_options copts{.lease = std::chrono::minutes{10}, .renew = false};
    // Nobody exits before all are done: a claim whose process is gone is fair
    // game (marker_claim recovers it), and a worker still racing for the
    // shared keys would take it over. The time ends at the last item won.
    double secs = dibs_bench::run_procs(procs, [&](int p, dibs_bench::gate& g) {
      long won = 0;
      const long first = p * items / procs, last = (p + 1) * items / procs;
      if (way == "dibs" && bench != "mailbox") {
        dibs::imap_store store{server, {.folder = folder}};
        dibs::marker_claim<dibs::imap_store> claims{store, copts};
        auto* keep = new std::vector<dibs::marker_claim<dibs::imap_store>::claim>;  // never given back
        keep->reserve(static_cast<std::size_t>(items));
        g.wait();
        const long from = bench == "own" ? first : 0, to = bench == "own" ? last : items;
        for (long k = from; k < to; ++k) {
          const auto t0 = mono_ns();
          auto c = claims.try_claim(key_of(k));
          sh->claim_ns += mono_ns() - t0;
          ++sh->claims;
          if (!c) continue;
          if (complete) c->complete();
          else keep->push_back(std::move(*c));
          ++won;
          ++sh->winners[k];
          g.end();
        }
      } else if (way == "floor" && bench != "mailbox") {
        hand h{folder, sh};
        g.wait();
        if (bench == "own") {
          for (long k = first; k < last; ++k) {
            h.append_and_read(key_of(k), "claim");
            if (complete) h.append_and_read(key_of(k), "completed");
            ++won;
            ++sh->winners[k];
            g.end();
          }
        } else {
          for (long k = 0; k < items; ++k) {
            const auto key = key_of(k);
            if (h.claimed(key) || !h.race(key)) continue;
            ++won;
            ++sh->winners[k];
            g.end();
          }
        }
      } else if (way == "dibs") {
        dibs::imap_store store{server, {.folder = folder}};
        dibs::imap_mailbox_options mopts{.mailbox = inbox, .claims = copts};
        if (no_processing) mopts.processing_keyword.clear();
        dibs::imap_mailbox box{server, store, mopts};
        g.wait();
        while (sh->handled.load() < items) {
          auto m = box.next(std::chrono::milliseconds{200});
          if (!m) continue;
          const auto uid = m->uid();
          m->complete("shipped");
          if (uid < 1 || uid > static_cast<std::uint32_t>(items)) throw std::runtime_error("unexpected UID");
          ++sh->winners[uid - 1];
          ++won;
          ++sh->handled;
          g.end();
        }
      } else {
        hand claims{folder, sh};
        hand box{inbox, sh};
        std::vector<std::uint32_t> todo;
        for (const auto& line : box.s.run("UID SEARCH UNKEYWORD $Completed").untagged)
          for (const auto& v : dibs::imap::parse(line))
            if (v.number()) todo.push_back(static_cast<std::uint32_t>(*v.number()));
        std::shuffle(todo.begin(), todo.end(), claims.rng);  // workers spread over the backlog, as imap_mailbox does
        g.wait();
        for (const auto uid : todo) {
          const auto key = std::to_string(uid);
          if (claims.claimed(key) || !claims.race(key)) continue;
          const auto t0 = mono_ns();
          const auto body = box.s.run(fmt::format("UID FETCH {} (UID BODY.PEEK[])", uid));
          box.s.check(body, "UID FETCH body");
          if (body.untagged.empty()) throw std::runtime_error("message gone");
          if (complete) claims.append_and_read(key, "completed");
          box.s.check(box.s.run(fmt::format("UID STORE {} +FLAGS.SILENT ($Completed)", uid)), "UID STORE");
          sh->work_ns += mono_ns() - t0;
          ++sh->works;
          ++sh->winners[uid - 1];
          ++won;
          ++sh->handled;
          g.end();
        }
      }
      sh->won[p] = won;
    }, {.stay_until_all_done = true});

    long total = 0;
    std::string per;
    for (int p = 0; p < procs; ++p) {
      total += sh->won[p];
      per += fmt::format("{}{}", p ? ", " : "", sh->won[p].load());
    }
    long zero = 0, many = 0;
    for (long k = 0; k < items; ++k) {
      zero += sh->winners[k] == 0;
      many += sh->winners[k] > 1;
    }
    // What the store says, read afresh: every key claimed, none twice.
    long recorded = items;
    if (way == "dibs" && bench != "mailbox") recorded = static_cast<long>(dibs::imap_store{server, {.folder = folder}}.keys("job-").size());
    if (total != items || zero || many || recorded != items) {
      std::fprintf(stderr, "check failed: %ld won, %ld keys without a winner, %ld with more than one, %ld in the store, of %ld\n",
                   total, zero, many, recorded, items);
      return 1;
    }
    for (const auto& f : {folder, inbox})
      if (f == folder || bench == "mailbox") admin.run(fmt::format("DELETE {}", dibs::imap::quote(f)));
    auto avg_ms = [](const std::atomic<std::int64_t>& ns, const std::atomic<long>& n) {
      return n ? static_cast<double>(ns.load()) / static_cast<double>(n.load()) / 1e6 : 0.0;
    };
    std::printf("{\"mode\": \"%s\", \"complete\": %s, \"procs\": %d, \"items\": %ld, \"seconds\": %.4f, "
                "\"items_per_s\": %.1f, \"won_per_process\": [%s], \"one_winner_per_key\": true, "
                "\"append_ms\": %.3f, \"fetch_ms\": %.3f, \"try_claim_ms\": %.3f, \"body_and_store_ms\": %.3f, "
                "\"refetches\": %ld}\n",
                mode.c_str(), complete ? "true" : "false", procs, items, secs, static_cast<double>(total) / secs,
                per.c_str(), avg_ms(sh->append_ns, sh->appends), avg_ms(sh->fetch_ns, sh->fetches),
                avg_ms(sh->claim_ns, sh->claims), avg_ms(sh->work_ns, sh->works), sh->refetches.load());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "imap_claims: %s\n", e.what());
    return 1;
  }
}
