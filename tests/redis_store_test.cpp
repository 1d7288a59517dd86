// redis_store on a real Redis server (scripts/redis.sh, started by the ctest
// fixture `redis`, its directory in DIBS_REDIS_DIR): the conformance kit,
// locks and claims with worker and server SIGKILLs, lost replies, bad input.
#include <dibs/lease_mutex.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/stores/redis_store.hpp>
#include <dibs/testing/store_conformance.hpp>

#include <catch2/catch.hpp>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "exactly_once.hpp"
#include "support.hpp"

using namespace std::chrono_literals;
using dibs_test::slurp;
using dibs_test::spit;
using dibs_test::temp_dir;
namespace fs = std::filesystem;

namespace {

std::string dir() {
  const char* d = std::getenv("DIBS_REDIS_DIR");
  if (!d) throw std::runtime_error("DIBS_REDIS_DIR is not set: run the Redis tests through ctest (fixture redis)");
  return d;
}
std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}
std::string url(const std::string& d = dir()) { return first_line(d + "/url"); }

/// Runs scripts/redis.sh `cmd` on the server in `d` (kill, restart, ...).
void script(const std::string& cmd, const std::string& d = dir(), const std::string& more = {}) {
  const std::string line = std::string(DIBS_SOURCE_DIR) + "/scripts/redis.sh " + cmd + " " + d + " " + more;
  if (std::system(line.c_str()) != 0) throw std::runtime_error("failed: " + line);
}

/// A namespace no test used before.
std::string fresh_ns(const std::string& stem) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{}-{:x}", stem, rng() & 0xffffffffffull);
}

dibs::redis_store open_store(const std::string& ns) { return dibs::redis_store{url(), {.ns = ns}}; }

/// One command on a connection of its own, as a person's redis-cli would
/// send it. Returns: the reply as text (an integer as digits, an error as
/// "ERR ...").
std::string raw(const std::vector<std::string>& args, const std::string& d = dir()) {
  redisContext* c = ::redisConnect("127.0.0.1", std::stoi(first_line(d + "/port")));
  REQUIRE(c);
  REQUIRE(c->err == 0);
  const std::string pw = first_line(d + "/password");
  ::freeReplyObject(::redisCommand(c, "AUTH %b", pw.data(), pw.size()));
  std::vector<const char*> argv;
  std::vector<std::size_t> lens;
  for (const auto& a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  auto* r = static_cast<redisReply*>(::redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()));
  std::string out;
  if (r && (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_ERROR))
    out.assign(r->str, r->len);
  else if (r && r->type == REDIS_REPLY_INTEGER)
    out = std::to_string(r->integer);
  ::freeReplyObject(r);
  ::redisFree(c);
  return out;
}

}  // namespace

TEST_CASE("redis_store passes the conformance suite, in one process and across 8", "[conformance]") {
  const auto ns = fresh_ns("conf");
  auto s = open_store(ns);
  REQUIRE_NOTHROW(dibs::testing::check_semantics(s, "sem-"));
  REQUIRE_NOTHROW(dibs::testing::check_bad_input(s, "bad-"));
  REQUIRE_NOTHROW(dibs::testing::check_any_keys(s, "any-"));
  REQUIRE_NOTHROW(dibs::testing::check_races_threads(s, 8, 100, "thr-"));
  REQUIRE_NOTHROW(dibs::testing::check_create_race_processes([&] { return open_store(ns); }, 8, "race-create"));
  REQUIRE_NOTHROW(dibs::testing::check_counter_race_processes([&] { return open_store(ns); }, 8, 200, "race-counter"));
  // A person's DEL in redis-cli.
  REQUIRE_NOTHROW(dibs::testing::check_removed_by_hand(s, "hand-", [&](std::string_view key) {
    REQUIRE(raw({"DEL", "{" + ns + "}:r:" + std::string(key)}) == "1");
  }));
}

TEST_CASE("redis_store: records are hashes a person can read, keys() comes from an index, and a key deleted by hand leaves it") {
  const auto ns = fresh_ns("shape");
  auto s = open_store(ns);
  const auto v = s.create("job/1", "hello");
  REQUIRE(v);
  CHECK(raw({"HGET", "{" + ns + "}:r:job/1", "d"}) == "hello");
  CHECK(raw({"HGET", "{" + ns + "}:r:job/1", "v"}) == std::to_string(*v));
  CHECK(raw({"GET", "{" + ns + "}:seq"}) == std::to_string(*v));
  REQUIRE(s.create("job/2", "x"));
  REQUIRE(s.create("other", "y"));
  auto ks = s.keys("job/");
  std::sort(ks.begin(), ks.end());
  CHECK(ks == std::vector<std::string>{"job/1", "job/2"});
  CHECK(s.keys().size() == 3);
  REQUIRE(raw({"DEL", "{" + ns + "}:r:job/2"}) == "1");
  CHECK(s.keys("job/") == std::vector<std::string>{"job/1"});
  CHECK(raw({"ZCARD", "{" + ns + "}:keys"}) == "2");  // the index let go of it
  // The server's clock: a fresh record is young, now() is TIME.
  const auto aged = s.read_aged("job/1");
  REQUIRE(aged);
  CHECK(aged->age < 60s);
  CHECK(std::chrono::abs(s.now() - std::chrono::system_clock::now()) < 60s);
}

TEST_CASE("a waiter on Redis wakes on the holder's unlock (PUBLISH), not on its next poll") {
  const auto ns = fresh_ns("wake");
  auto s = open_store(ns), t = open_store(ns);
  dibs::lease_mutex<dibs::redis_store> holder{s, "job", {.lease = 30s}};
  REQUIRE(holder.try_lock());
  // The waiter's first wait subscribes and returns at once; its next waits
  // sleep until a change, up to 60 s here.
  CHECK(t.wait_for_change("job", 60s));
  std::atomic<long long> woke_ns{0};
  std::thread waiter{[&] {
    (void)t.wait_for_change("job", 60s);
    woke_ns = dibs_test::steady_ns();
  }};
  // The waiter's connection is subscribed already (the wait above): the
  // unlock's message reaches it whenever the thread gets to its wait.
  const auto unlocked_ns = dibs_test::steady_ns();
  holder.unlock();
  waiter.join();
  INFO("woke " << (woke_ns.load() - unlocked_ns) / 1'000'000 << " ms after the unlock");
  CHECK(woke_ns.load() - unlocked_ns < 30'000'000'000LL);  // far below the 60 s wait: a loaded machine keeps it
}

TEST_CASE("bad input on Redis: a wrong password, no server, not a Redis server, a read-only replica, a server that does not fsync always, bad names", "[server-alone]") {
  const auto ns = fresh_ns("bad");
  const std::string port = first_line(dir() + "/port");
  auto code = [](auto&& f) -> std::error_code {
    try {
      f();
    } catch (const std::system_error& e) {
      return e.code();
    }
    return {};
  };
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const std::system_error& e) {
      return e.what();
    }
    return {};
  };
  const auto wrong = "redis://default:wrong@127.0.0.1:" + port;
  CHECK(code([&] { dibs::redis_store s{wrong, {.ns = ns}}; }) == std::errc::permission_denied);
  CHECK_FALSE(dibs::is_transient(code([&] { dibs::redis_store s{wrong, {.ns = ns}}; })));
  CHECK(message([&] { dibs::redis_store s{wrong, {.ns = ns}}; }).find("127.0.0.1:" + port) != std::string::npos);
  CHECK(message([&] { dibs::redis_store s{wrong, {.ns = ns}}; }).find("wrong") == std::string::npos);  // no secret
  CHECK(code([&] { dibs::redis_store s{"redis://127.0.0.1:" + port, {.ns = ns}}; }) == std::errc::permission_denied);
  // No server: transient, naming it.
  {
    temp_dir d;
    const int probe = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(probe, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socklen_t len = sizeof a;
    REQUIRE(::getsockname(probe, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    const auto free_port = std::to_string(ntohs(a.sin_port));
    ::close(probe);  // bound, never listened: nobody answers there
    const auto e = code([&] { dibs::redis_store s{"redis://127.0.0.1:" + free_port, {.ns = ns}}; });
    CHECK(dibs::is_transient(e));
  }
  // Not a Redis server: one that answers as a web server does.
  {
    const int l = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(l, 4) == 0);
    socklen_t len = sizeof a;
    REQUIRE(::getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    std::thread web{[l] {
      const int c = ::accept(l, nullptr, nullptr);
      if (c < 0) return;
      const std::string r = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n";
      (void)::send(c, r.data(), r.size(), MSG_NOSIGNAL);
      ::shutdown(c, SHUT_RDWR);
      ::close(c);
    }};
    const auto m = message([&] { dibs::redis_store s{"redis://127.0.0.1:" + std::to_string(ntohs(a.sin_port)), {.ns = ns}}; });
    web.join();
    ::close(l);
    INFO(m);
    CHECK(m.find("127.0.0.1:" + std::to_string(ntohs(a.sin_port))) != std::string::npos);
  }
  // Bad names, before anything is sent.
  CHECK(code([&] { dibs::redis_store s{url(), {.ns = "a b"}}; }) == dibs::errc::invalid_argument);
  CHECK(code([&] { dibs::redis_store s{url(), {.ns = ""}}; }) == dibs::errc::invalid_argument);
  CHECK(code([&] { dibs::redis_store s{url(), {.ns = ns, .replicas = -1}}; }) == dibs::errc::invalid_argument);
  CHECK(message([&] { dibs::redis_store s{url(), {.ns = ns, .replicas = 1, .replica_timeout = 0ms}}; })
            .find("replica_timeout at least 1 ms") != std::string::npos);
  CHECK(code([&] { dibs::redis_store s{"http://127.0.0.1:6379", {.ns = ns}}; }) == dibs::errc::invalid_argument);
  CHECK(code([&] { dibs::redis_store s{"redis://127.0.0.1:99999", {.ns = ns}}; }) == dibs::errc::invalid_argument);
  CHECK(code([&] { dibs::redis_store s{"rediss://127.0.0.1:6379", {.ns = ns}}; }) == std::errc::not_supported);
  CHECK(message([&] { dibs::redis_store s{"redis://u:secret@127.0.0.1:99999", {.ns = ns}}; }).find("secret") ==
        std::string::npos);
  // A replica (read-only) of the tests' server, whose append-only file is
  // fsync'd every second: writes are refused, naming the server, and
  // require_fsync_always refuses it at once.
  temp_dir rd;
  const auto replica = (rd.path / "replica").string();
  script("start", replica, "--fsync everysec --replica-of " + dir());
  {
    dibs::redis_store r{url(replica), {.ns = ns}};
    const auto e = code([&] { (void)r.create("k", "v"); });
    CHECK(e == std::errc::read_only_file_system);
    CHECK_FALSE(dibs::is_transient(e));
    CHECK(message([&] { (void)r.create("k", "v"); }).find("read-only replica") != std::string::npos);
    const auto f = message([&] { dibs::redis_store s{url(replica), {.ns = ns, .require_fsync_always = true}}; });
    CHECK(f.find("appendfsync everysec") != std::string::npos);
    CHECK_NOTHROW(dibs::redis_store{url(), {.ns = ns, .require_fsync_always = true}});  // the tests' server: always
  }
  script("stop", replica);
}

TEST_CASE("a write whose reply was held back is outcome_unknown, and its connection is ended so that it never lands", "[server-alone]") {
  // CLIENT PAUSE WRITE holds every write (and a script that may write) back
  // while reads go on: the store's create times out waiting for its reply.
  // The store's next command ends that connection first (CLIENT KILL ID and
  // ADDR), so the create, still queued on the server, never runs, and a
  // read-back that finds no record is the truth.
  const auto ns = fresh_ns("lost");
  dibs::redis_store s{url(), {.ns = ns, .timeout = 300ms, .sessions = 1}};
  REQUIRE(s.create("warm", "up"));  // the script is loaded before the pause
  REQUIRE(raw({"CLIENT", "PAUSE", "3000", "WRITE"}) == "OK");
  std::error_code e;
  try {
    (void)s.create("k", "mine");
  } catch (const std::system_error& x) {
    e = x.code();
  }
  CHECK(e == dibs::errc::outcome_unknown);
  CHECK_FALSE(s.read("k"));  // through a new connection, which ended the old one first
  REQUIRE(raw({"CLIENT", "UNPAUSE"}) == "OK");
  // Evidence that writes run again: one of another store lands.
  auto other = open_store(ns);
  REQUIRE(dibs_test::eventually([&] { return other.create("after", "x").has_value(); }, 10s));
  CHECK_FALSE(s.read("k"));  // the held-back create never ran
  // And the policies' way through it: store_create reads back and writes again.
  CHECK(dibs::detail::store_create(s, "k", "mine", std::chrono::steady_clock::now() + 10s).has_value());
  CHECK(s.read("k")->value == "mine");
}

namespace {

// workers processes each take a lease_mutex<redis_store> `cycles` times and,
// holding it, increment a counter file that also keeps the token of the
// last holder: a token not above the last is an overlap (tokens must only
// grow). Meanwhile `kills` workers are SIGKILLed (each replaced), and the
// server is SIGKILLed and restarted `crashes` times.
void lock_chaos(int workers, int cycles, int kills, int crashes) {
  const auto ns = fresh_ns("lockchaos");
  temp_dir d;
  const auto counter = d.path / "counter.txt";
  spit(counter, "0 0\n");
  int acks[2];
  REQUIRE(::pipe(acks) == 0);
  auto start_worker = [&](int n) {
    return dibs_test::spawn([&, n] {
      ::close(acks[0]);
      auto s = dibs::detail::retry_transient(dibs::time_limit::max(), [&] { return open_store(ns); });
      dibs::lease_mutex<dibs::redis_store> lock{s, "counter", {.lease = 10s}};
      for (int i = 0; i < n; ++i) {
        char ack = '+';
        {
          std::scoped_lock hold{lock};
          long value = 0;
          unsigned long long last_token = 0;
          std::ifstream in(counter);
          in >> value >> last_token;
          if (!in || last_token >= lock.token()) ack = 'X';
          spit(counter.string() + ".tmp", fmt::format("{} {}\n", value + 1, lock.token()));
          fs::rename(counter.string() + ".tmp", counter);
        }
        if (::write(acks[1], &ack, 1) != 1) return 3;
      }
      return 0;
    });
  };
  std::vector<pid_t> pids;
  for (int i = 0; i < workers; ++i) pids.push_back(start_worker(cycles));
  long acked = 0, overlaps = 0;
  auto drain = [&](int ms) {
    pollfd p{acks[0], POLLIN, 0};
    if (::poll(&p, 1, ms) <= 0) return false;
    char buf[4096];
    const ssize_t n = ::read(acks[0], buf, sizeof buf);
    for (ssize_t i = 0; i < n; ++i) (buf[i] == '+' ? acked : overlaps)++;
    return n > 0;
  };
  // Each kill (of a worker, or of the server) comes after another share of
  // the acknowledged sections: evidence that the run is under way, however
  // fast the machine.
  const int events = kills + crashes, per_event = std::max(1, workers * cycles / (events + 2));
  std::mt19937 rng(7);
  int killed = 0, crashed = 0;
  for (int k = 0; k < events; ++k) {
    const long target = static_cast<long>(k + 1) * per_event;
    const auto give_up = std::chrono::steady_clock::now() + 120s;
    while (acked < target && std::chrono::steady_clock::now() < give_up) drain(5);
    if (k % std::max(1, events / std::max(1, crashes)) == 1 && crashed < crashes) {
      script("kill");
      script("restart");
      ++crashed;
    } else if (killed < kills) {
      const std::size_t victim = std::uniform_int_distribution<std::size_t>{0, pids.size() - 1}(rng);
      ::kill(pids[victim], SIGKILL);
      dibs_test::wait_exit(pids[victim]);
      pids[victim] = start_worker(cycles);
      ++killed;
    }
  }
  ::close(acks[1]);
  int failed = 0;
  for (pid_t p : pids) failed += dibs_test::wait_exit(p) != 0;
  while (drain(100)) {
  }
  ::close(acks[0]);
  long value = 0;
  std::ifstream(counter) >> value;
  INFO("acknowledged " << acked << ", counter " << value << ", workers killed " << killed << ", server crashes "
                       << crashed);
  CHECK(failed == 0);
  CHECK(overlaps == 0);
  CHECK(crashed == crashes);
  CHECK(acked >= static_cast<long>(cycles) * workers);
  CHECK(value >= acked);
  CHECK(value <= acked + killed);
}

}  // namespace

TEST_CASE("lease_mutex on Redis: 6 processes x 200 locked increments, 6 SIGKILLs and the server SIGKILLed and restarted once: no overlap, tokens only grow", "[server-alone]") {
  if (dibs_test::no_fork_with_threads) {
    WARN("SKIPPED under a sanitizer that cannot fork while threads run (TSan, ASan)");
    return;
  }
  lock_chaos(6, 200, 6, 1);
}

TEST_CASE("lease_mutex on Redis: 6 processes x 600 locked increments, 20 SIGKILLs and the server SIGKILLed and restarted 3 times: no overlap, tokens only grow", "[chaos][server-alone]") {
  if (dibs_test::no_fork_with_threads) {
    WARN("SKIPPED under a sanitizer that cannot fork while threads run (TSan, ASan)");
    return;
  }
  // 600 each (2,000 until issue 31): 32 s alone, but 192 s in the clang
  // preset's run beside the other tests, each increment two fsync'd writes;
  // the 23 kills and crashes still come a share of the increments apart.
  lock_chaos(6, 600, 20, 3);
}

TEST_CASE("exactly once on Redis: 8 workers, 5,000 items, 20 SIGKILLs, the server SIGKILLed and restarted twice", "[chaos][server-alone]") {
  if (dibs_test::no_fork_with_threads) {
    WARN("SKIPPED under a sanitizer that cannot fork while threads run (TSan, ASan)");
    return;
  }
  const auto items = fresh_ns("items"), journal = fresh_ns("journal");
  std::atomic<int> crashes{0};
  dibs_test::check_exactly_once_under_crashes(
      [&] { return open_store(items); }, [&] { return open_store(journal); }, 8, 5000, 20,
      [&](const std::function<bool()>& done) {
        for (int i = 0; i < 2 && !done(); ++i) {
          std::this_thread::sleep_for(700ms);
          if (done()) break;
          script("kill");
          script("restart");
          ++crashes;
        }
      });
  INFO("server crashes during the run: " << crashes.load());
  CHECK(crashes.load() == 2);
}

TEST_CASE("exactly once on Redis: 4 workers, 600 items, 6 SIGKILLs") {
  const auto items = fresh_ns("items"), journal = fresh_ns("journal");
  dibs_test::check_exactly_once_under_crashes([&] { return open_store(items); }, [&] { return open_store(journal); },
                                              4, 600, 6);
}

TEST_CASE("redis_store passes the queue checks: priorities, schedules, backoffs, claim_next_n, each item once across 8 processes", "[conformance]") {
  static_assert(dibs::claim_queue_store<dibs::redis_store>);
  const auto ns = fresh_ns("queueconf");
  auto s = open_store(ns);
  REQUIRE_NOTHROW(dibs::testing::check_queue(s, "q-"));
  REQUIRE_NOTHROW(dibs::testing::check_queue_race_processes([&] { return open_store(ns); }, 8, 600, "race-"));
}

TEST_CASE("take_claimable on Redis: the records it writes are byte for byte what marker_claim would, and its indexes follow each write") {
  const auto ns = fresh_ns("take");
  auto s = open_store(ns);
  dibs::marker_claim<dibs::redis_store> claims{s, {.renew = false}};
  const auto tag = "{" + ns + "}";
  REQUIRE(claims.offer("a-urgent", {.priority = 5}));
  REQUIRE(claims.offer("a-later", {.not_before = std::chrono::system_clock::now() + 1h}));
  REQUIRE(claims.offer("a-now"));
  REQUIRE(claims.offer("b-now"));
  REQUIRE(claims.offer("a-low", {.priority = -2}));
  CHECK(raw({"ZCARD", tag + ":d"}) == "1");       // a-later waits for its time
  CHECK(raw({"ZCARD", tag + ":q:0"}) == "2");     // a-now, b-now
  CHECK(raw({"ZCARD", tag + ":q:5"}) == "1");
  CHECK(raw({"HGET", tag + ":qk", "a-low"}) == "-2");
  // By priority, then key; only the prefix's; never the one not yet due.
  std::vector<std::string> order;
  for (int i = 0; i < 4; ++i) {
    auto c = claims.claim_next("a-");
    if (!c) break;
    order.push_back(c->key());
    // What the store holds is what the claim says it is: its version and a
    // record marker_claim reads as its own processing claim, attempt 1.
    const auto r = s.read(c->key());
    REQUIRE(r);
    CHECK(r->version == c->token());
    const auto h = dibs::detail::claim_record::parse_head(r->value);
    REQUIRE(h);
    CHECK(h->state == dibs::claim_state::processing);
    CHECK(h->attempts == 1u);
    CHECK(claims.status(c->key()).state == dibs::claim_state::processing);
    CHECK(raw({"ZSCORE", tag + ":p", c->key()}) == "0");
    c->release("again", 0ms);
    CHECK(raw({"ZSCORE", tag + ":p", c->key()}).empty());
    auto again = claims.try_claim(c->key());
    REQUIRE(again);
    CHECK(again->attempts() == 2u);
    again->complete();
  }
  CHECK(order == std::vector<std::string>{"a-urgent", "a-now", "a-low"});
  CHECK(raw({"ZCARD", tag + ":qp"}) == "1");  // only priority 0 is left: b-now
  auto b = claims.claim_next();
  REQUIRE(b);
  CHECK(b->key() == "b-now");
  CHECK(s.processing_keys() == std::vector<std::string>{"b-now"});
  b->complete();
  CHECK_FALSE(claims.claim_next());
  CHECK(s.processing_keys().empty());
  CHECK(raw({"EXISTS", tag + ":q:0"}) == "0");
  // A queued record deleted by hand is dropped from the queue when met.
  REQUIRE(claims.offer("gone"));
  REQUIRE(raw({"DEL", tag + ":r:gone"}) == "1");
  CHECK_FALSE(claims.claim_next());
  CHECK(raw({"HEXISTS", tag + ":qk", "gone"}) == "0");
}

TEST_CASE("claim_next on Redis: 8 workers take 3,000 offered items without knowing their keys, 10 SIGKILLs, each done once", "[chaos]") {
  const auto items = fresh_ns("queue"), journal = fresh_ns("queue_journal");
  dibs_test::check_claim_next_exactly_once([&] { return open_store(items); }, [&] { return open_store(journal); }, 8,
                                           3000, 10, 1500ms);
}

TEST_CASE("claim_next on Redis: 4 workers take 600 offered items without knowing their keys, 4 SIGKILLs, each done once") {
  const auto items = fresh_ns("queue"), journal = fresh_ns("queue_journal");
  dibs_test::check_claim_next_exactly_once([&] { return open_store(items); }, [&] { return open_store(journal); }, 4,
                                           600, 4, 1500ms);
}

TEST_CASE("worker_pool on Redis: 6 pool processes take 3,000 items while the server is SIGKILLed and restarted and 10 workers are SIGKILLed, each completed once", "[chaos][server-alone]") {
  if (dibs_test::no_fork_with_threads) {
    WARN("SKIPPED under a sanitizer that cannot fork while threads run (TSan, ASan)");
    return;
  }
  const auto items = fresh_ns("pool_items"), journal = fresh_ns("pool_journal");
  dibs_test::check_pool_exactly_once([&] { return open_store(items); }, [&] { return open_store(journal); }, 6, 3000,
                                     10, 2s, [&](const std::function<bool()>&) {
                                       std::this_thread::sleep_for(400ms);
                                       script("kill");
                                       script("restart");
                                     });
}

namespace {

// Starts a Redis server in `d` (scripts/redis.sh start d `more`), and stops
// it and removes its data at the end of the scope.
struct own_server {
  std::string d;
  own_server(std::string dir_, const std::string& more = {}) : d(std::move(dir_)) { script("start", d, more); }
  ~own_server() {
    try {
      script("stop", d);
    } catch (...) {
    }
  }
  own_server(const own_server&) = delete;
  own_server& operator=(const own_server&) = delete;
  pid_t pid() const { return static_cast<pid_t>(std::stol(first_line(d + "/redis.pid"))); }
};

}  // namespace

TEST_CASE("failover on Redis: writes made with replicas = 1 survive the primary's death and the replica's promotion, while acknowledged writes without it are lost, their tokens given again, and a write the replica cannot confirm fails") {
  temp_dir t;
  own_server primary{(t.path / "primary").string()};
  own_server replica{(t.path / "replica").string(), "--replica-of " + (t.path / "primary").string()};
  const std::string ns = fresh_ns("failover");
  dibs::redis_store waited{url(primary.d), {.ns = ns, .replicas = 1, .replica_timeout = 1000ms}};
  dibs::redis_store plain{url(primary.d), {.ns = ns}};
  constexpr int confirmed = 100, unconfirmed = 50;
  for (int i = 0; i < confirmed; ++i) REQUIRE(waited.create(fmt::format("w-{}", i), "held"));

  // The replica is cut off: stopped, so that it cannot connect again, and
  // its link ended by the primary, so that nothing written from now on
  // reaches it (not even from a socket's buffers).
  REQUIRE(::kill(replica.pid(), SIGSTOP) == 0);
  CHECK(raw({"CLIENT", "KILL", "TYPE", "replica"}, primary.d) == "1");
  dibs::version last_lost = 0;
  for (int i = 0; i < unconfirmed; ++i) {
    const auto v = plain.create(fmt::format("n-{}", i), "held");
    REQUIRE(v);  // acknowledged: the caller believes it holds
    last_lost = std::max(last_lost, *v);
  }
  try {
    (void)waited.create("x", "held");
    FAIL("a write that no replica confirmed was reported as done");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::outcome_unknown);
    CHECK_THAT(e.what(), Catch::Contains("reached 0 of the 1 replicas") && Catch::Contains("'x'") &&
                             Catch::Contains("127.0.0.1:" + first_line(primary.d + "/port")));
  }

  // The primary dies; the replica runs again and is made the primary.
  script("kill", primary.d);
  REQUIRE(::kill(replica.pid(), SIGCONT) == 0);
  script("promote", replica.d);
  dibs::redis_store after{url(replica.d), {.ns = ns}};
  int kept = 0, lost = 0;
  for (int i = 0; i < confirmed; ++i) kept += after.read(fmt::format("w-{}", i)).has_value();
  for (int i = 0; i < unconfirmed; ++i) lost += !after.read(fmt::format("n-{}", i)).has_value();
  CHECK(kept == confirmed);     // every write confirmed by WAIT 1 is there
  CHECK(lost == unconfirmed);   // each acknowledged write the replica never had is gone
  CHECK_FALSE(after.read("x"));
  // The hole docs/stores.md names: the token counter went back with the
  // failover, so a token the old primary gave out is given out again.
  const auto next = after.create("after", "held");
  REQUIRE(next);
  CHECK(*next <= last_lost);
}

TEST_CASE("lease_mutex on Redis: a holder stopped (SIGSTOP) past its lease loses the lock to a waiter, and is told when it runs again") {
  if (dibs_test::no_fork_with_threads) {
    WARN("SKIPPED under a sanitizer that cannot fork while threads run (TSan, ASan)");
    return;
  }
  const auto ns = fresh_ns("stopped");
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t holder = dibs_test::spawn([&] {
    auto s = open_store(ns);
    std::atomic<bool> lost{false};
    dibs::lease_mutex<dibs::redis_store> lock{s, "job", {.lease = 500ms, .on_lost = [&] { lost = true; }}};
    lock.lock();
    const std::string token = std::to_string(lock.token()) + "\n";
    if (::write(ready[1], token.data(), token.size()) != static_cast<ssize_t>(token.size())) return 2;
    // Stopped here past the lease; once running again, its renewal finds
    // the lease taken over and says so.
    for (const auto end = std::chrono::steady_clock::now() + 60s; !lost && std::chrono::steady_clock::now() < end;)
      std::this_thread::sleep_for(10ms);
    return lost.load() && lock.lost() ? 0 : 5;
  });
  char buf[32] = {};
  REQUIRE(::read(ready[0], buf, sizeof buf - 1) > 0);
  const dibs::version theirs = std::stoull(buf);
  REQUIRE(::kill(holder, SIGSTOP) == 0);
  auto s = open_store(ns);
  dibs::lease_mutex<dibs::redis_store> lock{s, "job", {.lease = 500ms}};
  // The holder cannot let go while stopped: the lock is taken over because
  // its lease ran out by the server's clock.
  REQUIRE(lock.try_lock_for(30s));
  CHECK(lock.token() > theirs);
  ::kill(holder, SIGCONT);
  CHECK(dibs_test::wait_exit(holder) == 0);  // its renewal failed and it was told
  CHECK_FALSE(lock.lost());
  lock.unlock();
  ::close(ready[0]);
  ::close(ready[1]);
}
