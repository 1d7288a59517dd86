// dibs::lease_semaphore on Windows, on the stores ported there (file_store,
// sqlite_store), under Wine: permits held across processes (this program
// started again in a helper role), holders() naming them, another N refused
// with nothing written, a holder ended by TerminateProcess whose permit
// comes back at once on proof, and 4 processes x 50 acquisitions of N=2
// counted by a named shared-memory board that the semaphore never touches.
// `--sem-hold`, `--sem-open` and `--sem-count` are its helper roles.
#include "win_support.hpp"

#include <dibs/lease_semaphore.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/stores/sqlite_store.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <future>
#include <iterator>
#include <memory>
#include <new>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace lease_semaphore_win_test {
namespace {

using namespace win_test;

// The stores, each opened on a directory of the test's (every process opens
// its own, as another program would).
struct file_kind {
  using store_type = dibs::file_store;
  static constexpr const wchar_t* name = L"file";
  static dibs::file_store open(const fs::path& dir) { return dibs::file_store{dir}; }
};
struct sqlite_kind {
  using store_type = dibs::sqlite_store;
  static constexpr const wchar_t* name = L"sqlite";
  static dibs::sqlite_store open(const fs::path& dir) { return dibs::sqlite_store{dir / "records.db"}; }
};

// Runs f(store) on the store `kind` names, opened on `dir`.
template <class F>
int with_store(const std::string& kind, const fs::path& dir, F&& f) {
  if (kind == "file") {
    auto s = file_kind::open(dir);
    return f(s);
  }
  if (kind == "sqlite") {
    auto s = sqlite_kind::open(dir);
    return f(s);
  }
  return 2;
}

// The holding role: opens the semaphore NAME with N permits, acquires one
// (lease 60 s, renewed), says "INDEX TOKEN" in OUT, and holds it until the
// file RELEASE appears (then releases it and exits 0); with RELEASE "-",
// until it is killed.
int sem_hold(const std::string& kind, const fs::path& dir, const std::string& name, std::uint32_t n,
             const fs::path& out, const std::string& release) {
  return with_store(kind, dir, [&](auto& store) -> int {
    using Store = std::remove_cvref_t<decltype(store)>;
    dibs::lease_semaphore<Store> sem{store, name, n, {.lease = 60s}};
    auto p = sem.acquire();
    put(out, fmt::format("{} {}\n", p.index(), p.token()));
    if (release == "-") {
      for (;;) ::Sleep(120'000);
    }
    if (!wait_for_file(release, 120s)) return 3;
    p.release();
    return 0;
  });
}

// The opening role: opens the semaphore NAME with N permits and says in
// OUT how it went: "ok HOLDERS" (holders() counted), or "invalid_argument"
// and the message on the next line, or "other" and the message.
int sem_open(const std::string& kind, const fs::path& dir, const std::string& name, std::uint32_t n,
             const fs::path& out) {
  return with_store(kind, dir, [&](auto& store) -> int {
    using Store = std::remove_cvref_t<decltype(store)>;
    try {
      dibs::lease_semaphore<Store> sem{store, name, n};
      put(out, fmt::format("ok {}\n", sem.holders().size()));
    } catch (const std::system_error& e) {
      put(out, fmt::format("{}\n{}\n", e.code() == dibs::errc::invalid_argument ? "invalid_argument" : "other", e.what()));
    }
    return 0;
  });
}

// What the counting processes share: a named file mapping (Win32's shared
// memory), apart from the store: an independent count of who is inside.
constexpr int board_permits = 2;
struct board {
  std::atomic<long> inside;                      // holders inside their held section now
  std::atomic<long> most;                        // the most ever inside at once
  std::atomic<long> enters, exits;               // held sections entered and left
  std::atomic<long> waited;                      // acquisitions that found every permit held first
  std::atomic<long> violations;                  // a permit index >= N, two holders of one permit, a token not larger, a hold lost
  std::atomic<long> occupant[board_permits];     // the pid inside with permit i (0: none)
  std::atomic<unsigned long long> fence[board_permits];  // the largest token seen for permit i
};
static_assert(std::atomic<long>::is_always_lock_free && std::atomic<unsigned long long>::is_always_lock_free);

// A view of the named mapping `name`: made (zeroed, then constructed) by
// the test, opened by the helpers.
class shared_board {
public:
  shared_board(const std::wstring& name, bool create) {
    mapping_ = create ? ::CreateFileMappingW(INVALID_HANDLE_VALUE, nullptr, PAGE_READWRITE, 0, sizeof(board), name.c_str())
                      : ::OpenFileMappingW(FILE_MAP_ALL_ACCESS, FALSE, name.c_str());
    if (!mapping_) return;
    view_ = ::MapViewOfFile(mapping_, FILE_MAP_ALL_ACCESS, 0, 0, sizeof(board));
    if (view_ && create) new (view_) board{};
  }
  shared_board(const shared_board&) = delete;
  shared_board& operator=(const shared_board&) = delete;
  ~shared_board() {
    if (view_) ::UnmapViewOfFile(view_);
    if (mapping_) ::CloseHandle(mapping_);
  }
  explicit operator bool() const noexcept { return view_ != nullptr; }
  board* operator->() const noexcept { return static_cast<board*>(view_); }
  board& operator*() const noexcept { return *static_cast<board*>(view_); }

private:
  HANDLE mapping_ = nullptr;
  void* view_ = nullptr;
};

void note_violation(board& b, const std::string& what) {
  ++b.violations;
  std::fprintf(stderr, "--sem-count: pid %lu: %s\n", ::GetCurrentProcessId(), what.c_str());
}

// The counting role: opens the semaphore "pool" (N=2), creates READY,
// waits for GO (all start together: under Wine a process takes a while to
// start, and one that ran alone would meet no other), then ROUNDS times
// acquires a permit (try_acquire first, counting a miss as a wait), enters
// the held section on the board, works 1 ms, leaves, releases.
int sem_count(const std::string& kind, const fs::path& dir, const std::wstring& board_name, const fs::path& ready,
              const fs::path& go, int rounds) {
  shared_board b{board_name, false};
  if (!b) return 4;
  return with_store(kind, dir, [&](auto& store) -> int {
    using Store = std::remove_cvref_t<decltype(store)>;
    dibs::lease_semaphore<Store> sem{store, "pool", board_permits, {.lease = 30s}};
    put(ready, "ready\n");
    if (!wait_for_file(go, 60s)) return 3;
    const long me = static_cast<long>(::GetCurrentProcessId());
    for (int r = 0; r < rounds; ++r) {
      auto p = sem.try_acquire();
      if (!p) {
        ++b->waited;
        p = sem.acquire();
      }
      const auto i = p.index();
      const auto token = p.token();
      if (i >= static_cast<std::uint32_t>(board_permits)) {
        note_violation(*b, fmt::format("permit {} of {} handed out", i, board_permits));
        return 5;
      }
      const long now = ++b->inside;
      for (long seen = b->most.load(); now > seen && !b->most.compare_exchange_weak(seen, now);) {
      }
      long none = 0;
      if (!b->occupant[i].compare_exchange_strong(none, me))
        note_violation(*b, fmt::format("permit {}: taken while pid {} holds it", i, none));
      if (const auto before = b->fence[i].load(); token <= before)
        note_violation(*b, fmt::format("permit {}: token {} after token {}", i, token, before));
      b->fence[i] = token;
      ++b->enters;
      std::this_thread::sleep_for(1ms);  // the work the permit guards
      long mine = me;
      if (!b->occupant[i].compare_exchange_strong(mine, 0))
        note_violation(*b, fmt::format("permit {}: pid {} inside on leaving", i, mine));
      --b->inside;
      ++b->exits;
      if (p.lost()) note_violation(*b, fmt::format("permit {}: hold lost (token {})", i, token));
      p.release();
    }
    return 0;
  });
}

const register_role hold_role{"--sem-hold", [](int argc, char** argv) {
  return argc == 6 ? guarded("--sem-hold",
                             [&] {
                               return sem_hold(argv[0], argv[1], argv[2], static_cast<std::uint32_t>(std::atoi(argv[3])),
                                               argv[4], argv[5]);
                             })
                   : 2;
}};
const register_role open_role{"--sem-open", [](int argc, char** argv) {
  return argc == 5 ? guarded("--sem-open",
                             [&] {
                               return sem_open(argv[0], argv[1], argv[2], static_cast<std::uint32_t>(std::atoi(argv[3])),
                                               argv[4]);
                             })
                   : 2;
}};
const register_role count_role{"--sem-count", [](int argc, char** argv) {
  return argc == 6 ? guarded("--sem-count",
                             [&] {
                               const std::string name = argv[2];
                               return sem_count(argv[0], argv[1], std::wstring(name.begin(), name.end()), argv[3],
                                                argv[4], std::atoi(argv[5]));
                             })
                   : 2;
}};

// The names of the files of `dir`, sorted.
std::vector<std::string> file_names(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator{dir}) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("Windows lease_semaphore: N=3 held by two processes, the fourth gets in only after a release, tokens rising per permit",
                   "", file_kind, sqlite_kind) {
  using Store = typename TestType::store_type;
  temp_dir dir;
  const auto store_dir = dir.path / "store";
  fs::create_directories(store_dir);
  auto store = TestType::open(store_dir);
  dibs::lease_semaphore<Store> sem{store, "exports", 3, {.lease = 30s}};

  const auto said = dir.path / "held", release = dir.path / "release";
  child other{{L"--sem-hold", TestType::name, store_dir.wstring(), L"exports", L"3", said.wstring(), release.wstring()}};
  REQUIRE(wait_for_file(said, 60s));
  const auto w = words(get(said));
  REQUIRE(w.size() == 2);
  const auto their_index = static_cast<std::uint32_t>(std::stoul(w[0]));
  const dibs::version their_token = std::stoull(w[1]);
  CHECK(their_token > 0);

  auto a = sem.acquire();
  auto b = sem.try_acquire_for(5s);
  REQUIRE(a);
  REQUIRE(b);
  CHECK(std::set<std::uint32_t>{a.index(), b.index(), their_index} == std::set<std::uint32_t>{0, 1, 2});
  CHECK(a.token() > 0);
  CHECK(b.token() > 0);
  CHECK_FALSE(sem.try_acquire());  // three held, across two processes
  CHECK_FALSE(sem.try_acquire_for(100ms));

  // holders(): each permit, its holder's pid and the token it was given.
  const auto hs = sem.holders();
  REQUIRE(hs.size() == 3);
  for (const auto& h : hs) {
    INFO("permit " << h.permit);
    CHECK_FALSE(h.above_limit);
    CHECK_FALSE(h.holder.gone);
    CHECK(h.holder.since.has_value());
    CHECK(h.holder.host == dibs::detail::host_name());
    if (h.permit == their_index) {
      CHECK(h.holder.pid == static_cast<long>(other.pi.dwProcessId));
      CHECK(h.holder.token == their_token);
    } else {
      CHECK(h.holder.pid == static_cast<long>(::GetCurrentProcessId()));
      CHECK(h.holder.token == (h.permit == a.index() ? a : b).token());
    }
  }

  // The fourth waits (as acquire() does; bounded, so that a failure ends
  // the test) until the other process releases its permit, then holds that
  // permit with a larger token than it ever had.
  auto fourth = std::async(std::launch::async, [&] { return sem.try_acquire_for(90s); });
  CHECK(fourth.wait_for(300ms) == std::future_status::timeout);
  put(release, "release\n");
  CHECK(other.wait(60s) == DWORD{0});
  REQUIRE(fourth.wait_for(90s) == std::future_status::ready);
  auto d = fourth.get();
  REQUIRE(d);
  CHECK(d.index() == their_index);
  CHECK(d.token() > their_token);

  // Tokens grow per permit, acquisition after acquisition (the other two
  // held, so each acquisition gets this one permit).
  for (int i = 0; i < 5; ++i) {
    const auto before = d.token();
    d.release();
    d = sem.acquire();
    CHECK(d.index() == their_index);
    CHECK(d.token() > before);
  }
  const auto b_index = b.index();
  const auto b_token = b.token();
  b.release();
  CHECK_FALSE(b);
  auto e = sem.try_acquire();
  REQUIRE(e);
  CHECK(e.index() == b_index);
  CHECK(e.token() > b_token);
  a.release();
  d.release();
  e.release();
  CHECK(sem.holders().empty());
}

TEMPLATE_TEST_CASE("Windows lease_semaphore: another N is refused, here and in another process, with a clear error and nothing written",
                   "", file_kind, sqlite_kind) {
  using Store = typename TestType::store_type;
  using sem_t = dibs::lease_semaphore<Store>;
  temp_dir dir;
  const auto store_dir = dir.path / "store";
  fs::create_directories(store_dir);
  auto store = TestType::open(store_dir);
  const auto invalid = [](auto&& make, const std::string& says) {
    try {
      make();
      FAIL("no error");
    } catch (const std::system_error& e) {
      CHECK(e.code() == dibs::errc::invalid_argument);
      CHECK_THAT(e.what(), Catch::Contains(says));
    }
  };
  invalid([&] { sem_t{store, "jobs", 0}; }, "0 permits: a semaphore has 1 to 10000 permits");
  invalid([&] { sem_t{store, "jobs", 10'001}; }, "10001 permits");
  invalid([&] { sem_t{store, "", 3}; }, "invalid name '': a semaphore's name must not be empty");
  invalid([&] { sem_t{store, "jobs", 3, {.lease = 1ms}}; }, "lease must be at least 3 ms");
  invalid([&] { sem_t::resize(store, "jobs", 3); }, "there is no semaphore 'jobs'");
  CHECK(store.keys().empty());

  sem_t sem{store, "jobs", 3};
  auto p = sem.acquire();
  const auto before = store.read("dibs-semaphore:jobs");
  REQUIRE(before);
  CHECK(before->value == "dibs-semaphore 1\npermits 3\nhighest 3\n");
  if constexpr (std::is_same_v<Store, dibs::file_store>) {
    // ':' is written %3A in a Windows file name; the permit's record names its holder.
    CHECK(store.path_of("dibs-semaphore:jobs").filename().string() == "dibs-semaphore%3Ajobs.rec");
    const auto permit_file = store.path_of(fmt::format("dibs-semaphore-permit-{}:jobs", p.index()));
    CHECK(permit_file.filename().string() == fmt::format("dibs-semaphore-permit-{}%3Ajobs.rec", p.index()));
    CHECK_THAT(get(permit_file), Catch::Contains(fmt::format("pid {}\n", ::GetCurrentProcessId())));
  }
  const auto keys_before = store.keys();
  const auto files_before = file_names(store_dir);

  const std::string says = "opened with 4 permits, but the semaphore has 3 (its record 'dibs-semaphore:jobs' says so); "
                           "open it with 3, or change it for every user with lease_semaphore::resize(store, name, 4)";
  invalid([&] { sem_t{store, "jobs", 4}; }, says);
  const auto out = dir.path / "opened";
  child other{{L"--sem-open", TestType::name, store_dir.wstring(), L"jobs", L"4", out.wstring()}};
  REQUIRE(other.wait(60s) == DWORD{0});
  const auto text = get(out);
  CHECK_THAT(text, Catch::StartsWith("invalid_argument\n") && Catch::Contains("dibs::lease_semaphore 'jobs': " + says));

  // Nothing written, by either: the record, its version, the keys and (file_store) the files are as they were.
  const auto after = store.read("dibs-semaphore:jobs");
  REQUIRE(after);
  CHECK(after->version == before->version);
  CHECK(after->value == before->value);
  CHECK(store.keys() == keys_before);
  if constexpr (std::is_same_v<Store, dibs::file_store>) CHECK(file_names(store_dir) == files_before);

  // The same N opens it, in another process too, and sees the holder.
  const auto out3 = dir.path / "opened-3";
  child same{{L"--sem-open", TestType::name, store_dir.wstring(), L"jobs", L"3", out3.wstring()}};
  REQUIRE(same.wait(60s) == DWORD{0});
  CHECK(get(out3) == "ok 1\n");
}

TEMPLATE_TEST_CASE("Windows lease_semaphore: a holder ended by TerminateProcess gives its permit back at once on proof, not after its 60 s lease",
                   "", file_kind, sqlite_kind) {
  using Store = typename TestType::store_type;
  temp_dir dir;
  const auto store_dir = dir.path / "store";
  fs::create_directories(store_dir);
  auto store = TestType::open(store_dir);
  dibs::lease_semaphore<Store> sem{store, "jobs", 2, {.lease = 60s}};

  const auto said = dir.path / "held";
  child holder{{L"--sem-hold", TestType::name, store_dir.wstring(), L"jobs", L"2", said.wstring(), L"-"}};
  REQUIRE(wait_for_file(said, 60s));
  const auto w = words(get(said));
  REQUIRE(w.size() == 2);
  const auto their_index = static_cast<std::uint32_t>(std::stoul(w[0]));
  const dibs::version their_token = std::stoull(w[1]);

  auto mine = sem.acquire();
  CHECK(mine.index() != their_index);
  CHECK_FALSE(sem.try_acquire());  // the holder runs: its permit is respected
  CHECK_FALSE(sem.try_acquire_for(300ms));
  auto hs = sem.holders();
  REQUIRE(hs.size() == 2);
  const auto& theirs = hs[0].permit == their_index ? hs[0] : hs[1];
  CHECK(theirs.holder.pid == static_cast<long>(holder.pi.dwProcessId));
  CHECK(theirs.holder.token == their_token);
  CHECK(theirs.holder.lease == 60s);
  CHECK_FALSE(theirs.holder.gone);

  holder.kill();  // its handle stays open here: the process object lives on, exited
  hs = sem.holders();
  REQUIRE(hs.size() == 2);
  CHECK((hs[0].permit == their_index ? hs[0] : hs[1]).holder.gone);
  const auto t0 = std::chrono::steady_clock::now();
  auto back = sem.try_acquire_for(20s);
  const auto took = std::chrono::steady_clock::now() - t0;
  REQUIRE(back);
  INFO("taken back after " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms");
  CHECK(took < 10s);  // at once (ms), far below the 60 s lease; wide for a loaded machine
  CHECK(back.index() == their_index);
  CHECK(back.token() > their_token);
  hs = sem.holders();
  REQUIRE(hs.size() == 2);
  for (const auto& h : hs) CHECK(h.holder.pid == static_cast<long>(::GetCurrentProcessId()));
}

TEMPLATE_TEST_CASE("Windows lease_semaphore: 4 processes x 50 acquisitions of N=2, never more than 2 inside by a shared-memory count",
                   "", file_kind, sqlite_kind) {
  using Store = typename TestType::store_type;
  constexpr int procs = 4, rounds = 50;
  temp_dir dir;
  const auto store_dir = dir.path / "store";
  fs::create_directories(store_dir);
  auto store = TestType::open(store_dir);
  dibs::lease_semaphore<Store> sem{store, "pool", board_permits, {.lease = 30s}};
  const std::wstring board_name =
      L"dibs-sem-win-test-" + std::to_wstring(::GetCurrentProcessId()) + L"-" + std::to_wstring(std::random_device{}());
  shared_board b{board_name, true};
  REQUIRE(b);

  const auto go = dir.path / "go";
  std::vector<std::unique_ptr<child>> kids;
  for (int i = 0; i < procs; ++i)
    kids.push_back(std::make_unique<child>(std::vector<std::wstring>{
        L"--sem-count", TestType::name, store_dir.wstring(), board_name,
        (dir.path / fmt::format("ready-{}", i)).wstring(), go.wstring(), std::to_wstring(rounds)}));
  for (int i = 0; i < procs; ++i) REQUIRE(wait_for_file(dir.path / fmt::format("ready-{}", i), 60s));
  const auto t0 = std::chrono::steady_clock::now();
  put(go, "go\n");
  for (auto& k : kids) CHECK(k->wait(120s) == DWORD{0});
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);

  INFO("most inside " << b->most.load() << ", enters " << b->enters.load() << ", exits " << b->exits.load()
                      << ", acquisitions that waited " << b->waited.load() << ", violations " << b->violations.load()
                      << ", " << took.count() << " ms");
  CHECK(b->violations.load() == 0);
  CHECK(b->most.load() <= board_permits);
  CHECK(b->most.load() == board_permits);  // the processes did meet: both permits held at once
  CHECK(b->waited.load() > 0);             // and some found both held and waited
  CHECK(b->enters.load() == procs * rounds);
  CHECK(b->exits.load() == procs * rounds);
  CHECK(b->inside.load() == 0);
  CHECK(sem.holders().empty());
}

}  // namespace lease_semaphore_win_test
