// dibs::shared_log on Windows (LockFileEx, FILE_APPEND_DATA, rotation by
// MoveFileExW), run under Wine in CI: writer processes (this program
// started again in the roles below) appending numbered records while
// TerminateProcess kills them, rotation under concurrent writers, a dead
// holder's torn record cut by the next one, and bad paths.
#include "win_support.hpp"

#include <dibs/error.hpp>
#include <dibs/shared_log.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace shared_log_win_test {
namespace {

using namespace win_test;

// The record of writer `id` numbered `seq`: its length varies (10 to 150
// bytes of payload), so that a torn or interleaved line cannot pass for
// another whole record.
std::string record_text(long id, long seq) {
  std::string s = fmt::format("w{} s{} ", id, seq);
  const long n = 10 + (seq * 7 + id * 13) % 140;
  for (long k = 0; k < n; ++k) s += static_cast<char>('a' + (seq + k) % 26);
  s += " end";
  return s;
}

// Returns: the writer and number of a whole record `line`, or {-1, -1}.
std::pair<long, long> parse_record(const std::string& line) {
  long id = -1, seq = -1;
  if (std::sscanf(line.c_str(), "w%ld s%ld ", &id, &seq) != 2) return {-1, -1};
  if (record_text(id, seq) != line) return {-1, -1};
  return {id, seq};
}

std::string slurp(const fs::path& p) {
  std::ifstream in{p, std::ios::binary};
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Returns: the whole lines (ended by \n) of `text`; `torn_tail` set if
// bytes follow the last \n.
std::vector<std::string> whole_lines(const std::string& text, bool* torn_tail = nullptr) {
  std::vector<std::string> out;
  std::size_t at = 0;
  for (std::size_t nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1) out.push_back(text.substr(at, nl - at));
  if (torn_tail) *torn_tail = at != text.size();
  return out;
}

// The writer role: appends records 0, 1, ... `count`-1 of writer `id` to the
// log (rotating at `rotate_size`, 0: never), and after each append that
// returned writes its number to `ack` (its own file): a record listed
// there was acknowledged. With a `gate` (not "-"), it starts appending once
// that file exists, so that writers started one after another (Wine starts
// a process in up to 3 s) append at the same time.
int write_records(const fs::path& log_path, const fs::path& ack_path, long id, long count, std::uint64_t rotate_size,
                  const fs::path& gate) {
  dibs::shared_log log{log_path, {.rotate_size = rotate_size}};
  if (gate != "-") {
    std::ofstream{gate.string() + "-" + std::to_string(id)} << "ready\n";
    if (!wait_for_file(gate, 60s)) return 3;
  }
  std::ofstream ack{ack_path, std::ios::app | std::ios::binary};
  for (long seq = 0; seq < count; ++seq) {
    log.append(record_text(id, seq));
    ack << seq << '\n' << std::flush;
    if (!ack) return 4;
  }
  return 0;
}
const register_role write_role{"--log-write", [](int argc, char** argv) {
  if (argc != 6) return 2;
  return write_records(argv[0], argv[1], std::atol(argv[2]), std::atol(argv[3]), std::strtoull(argv[4], nullptr, 10),
                       argv[5]);
}};

// The torn-holder role: appends "before", then plays a holder that dies in
// the middle of its write: takes the log's lock as shared_log does, records
// a pending record of 100 bytes at the end of the log in the lock file,
// writes 16 of them, creates `ready` and waits to be terminated.
int hold_torn(const fs::path& log_path, const fs::path& ready) {
  dibs::shared_log log{log_path};
  log.append("before");
  namespace w = dibs::detail::win32_log;
  const dibs::detail::unique_handle lock = w::open_lock_file(log.lock_path());
  while (w::try_lock(lock.get()) != 0) std::this_thread::sleep_for(1ms);
  dibs::detail::locked_log_state st{};
  DWORD e = 0;
  if (w::read_state(lock.get(), &st, sizeof st, e) != sizeof st) return 5;
  const dibs::detail::unique_handle f = w::open_append(log.path());
  w::file_info info;
  if (!w::info_of(f.get(), info)) return 6;
  st.pending_start = w::size_of(f.get());
  st.pending_len = 100;
  st.pending_volume = info.id.volume;
  st.pending_index = info.id.index;
  st.holder_pid = ::GetCurrentProcessId();
  st.holder_since_ms = w::wall_ms();
  if (w::write_state(lock.get(), &st, sizeof st) != 0) return 7;
  if (w::append(f.get(), "torn-half-record", 16) != 0) return 8;
  std::ofstream{ready} << "held\n";
  std::this_thread::sleep_for(120s);
  return 3;
}
const register_role torn_role{"--log-torn", [](int argc, char** argv) {
  if (argc != 2) return 2;
  return hold_torn(argv[0], argv[1]);
}};

fs::path ack_file(const temp_dir& dir, long id) { return dir.path / fmt::format("ack-{}.txt", id); }

// Checks the records of `files` (oldest first): every line a whole record
// of some writer, none twice, each writer's in increasing order, and every
// acknowledged one of writers `ids` present. Returns: the records found.
std::size_t check_records(const std::vector<fs::path>& files, const temp_dir& dir, const std::vector<long>& ids) {
  std::map<long, long> last;  // writer -> its last number seen
  std::set<std::pair<long, long>> seen;
  std::size_t torn = 0, twice = 0, out_of_order = 0;
  for (const auto& f : files) {
    bool tail = false;
    for (const auto& line : whole_lines(slurp(f), &tail)) {
      const auto r = parse_record(line);
      if (r.first < 0) {
        ++torn;
        UNSCOPED_INFO("torn or interleaved line in " << f.filename().string() << ": " << line);
        continue;
      }
      if (!seen.insert(r).second) ++twice;
      if (auto it = last.find(r.first); it != last.end() && it->second >= r.second) ++out_of_order;
      last[r.first] = r.second;
    }
    if (tail) {
      ++torn;
      UNSCOPED_INFO("torn tail at the end of " << f.filename().string());
    }
  }
  std::size_t acknowledged = 0, lost = 0;
  for (long id : ids) {
    for (const auto& line : whole_lines(slurp(ack_file(dir, id)))) {
      ++acknowledged;
      if (!seen.count({id, std::atol(line.c_str())})) {
        ++lost;
        UNSCOPED_INFO("acknowledged record lost: writer " << id << " number " << line);
      }
    }
  }
  INFO(acknowledged << " acknowledged records, " << seen.size() << " records in the log");
  CHECK(torn == 0);
  CHECK(twice == 0);
  CHECK(out_of_order == 0);
  CHECK(lost == 0);
  CHECK(acknowledged > 0);
  return seen.size();
}

std::string message_of(const fs::path& p, dibs::shared_log_options opts = {}) {
  try {
    dibs::shared_log log{p, opts};
    log.append("x");
  } catch (const std::system_error& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("Windows shared_log: 4 writer processes, 14 TerminateProcess kills, no acknowledged record lost, torn or doubled", "[chaos]") {
  temp_dir dir;
  const auto log_path = dir.path / "app.log";
  constexpr int writers = 4, min_kills = 14;
  std::mt19937 rng{std::random_device{}()};
  std::vector<std::unique_ptr<child>> running(writers);
  std::vector<long> current(writers), ids;
  std::vector<std::chrono::steady_clock::time_point> started(writers);
  long next_id = 1;
  auto start = [&](int slot) {
    const long id = next_id++;
    ids.push_back(id);
    current[static_cast<std::size_t>(slot)] = id;
    started[static_cast<std::size_t>(slot)] = std::chrono::steady_clock::now();
    running[static_cast<std::size_t>(slot)] = std::make_unique<child>(std::vector<std::wstring>{
        L"--log-write", log_path.wstring(), ack_file(dir, id).wstring(), std::to_wstring(id), L"1000000", L"0", L"-"});
  };
  for (int s = 0; s < writers; ++s) start(s);
  int kills = 0;
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (kills < min_kills && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds{50 + rng() % 250});
    const int s = static_cast<int>(rng() % writers);
    const auto idx = static_cast<std::size_t>(s);
    // Killed once it appends (a writer starts in about 3 s under Wine), at
    // a random point of its appends.
    if (lines(ack_file(dir, current[idx])) == 0 && std::chrono::steady_clock::now() - started[idx] < 15s) continue;
    running[idx]->kill();
    ++kills;
    start(s);
  }
  REQUIRE(kills >= min_kills);
  for (auto& c : running) {  // the last ones are terminated too, mid-append
    c->kill();
    ++kills;
  }
  // A dead writer's torn record is cut by the next holder: this one.
  {
    dibs::shared_log log{log_path};
    log.append(record_text(0, 0));
  }
  std::ofstream{ack_file(dir, 0)} << "0\n";
  ids.push_back(0);
  INFO(kills << " kills");
  const std::size_t records = check_records({log_path}, dir, ids);
  CHECK(records > 50);
}

TEST_CASE("Windows shared_log: rotation by size under 4 writer processes loses no record, and no record reaches a rotated file late", "[chaos]") {
  temp_dir dir;
  const auto log_path = dir.path / "rot.log";
  constexpr int writers = 4;
  constexpr long per_writer = 300;
  constexpr std::uint64_t rotate_size = 4096;
  const auto gate = dir.path / "gate";
  std::vector<std::unique_ptr<child>> procs;
  std::vector<long> ids;
  for (long id = 1; id <= writers; ++id) {
    ids.push_back(id);
    procs.push_back(std::make_unique<child>(std::vector<std::wstring>{
        L"--log-write", log_path.wstring(), ack_file(dir, id).wstring(), std::to_wstring(id),
        std::to_wstring(per_writer), std::to_wstring(rotate_size), gate.wstring()}));
  }
  for (long id : ids) REQUIRE(wait_for_file(gate.string() + "-" + std::to_string(id), 30s));
  std::ofstream{gate} << "go\n";
  for (auto& p : procs) CHECK(p->wait(120s) == DWORD{0});
  // Oldest first: the highest number, down to .1, then the log.
  std::vector<fs::path> files;
  std::uint64_t n = 1;
  while (fs::exists(log_path.string() + "." + std::to_string(n))) ++n;
  const std::uint64_t rotated = n - 1;
  for (std::uint64_t k = rotated; k >= 1; --k) {
    const fs::path f = log_path.string() + "." + std::to_string(k);
    const auto size = fs::file_size(f);
    INFO(f.filename().string() << ": " << size << " bytes");
    CHECK(size >= rotate_size);          // rotated only once full
    CHECK(size < rotate_size + 200);     // by the writer of the record that filled it
    files.push_back(f);
  }
  files.push_back(log_path);
  CHECK(rotated >= 5);
  CHECK(check_records(files, dir, ids) == writers * per_writer);
  for (long id : ids) CHECK(lines(ack_file(dir, id)) == static_cast<std::size_t>(per_writer));
}

TEST_CASE("Windows shared_log: keep bounds the rotated files, the newest kept, none left behind under another name") {
  temp_dir dir;
  const auto log_path = dir.path / "keep.log";
  {
    dibs::shared_log log{log_path, {.rotate_size = 300, .keep = 2}};
    dibs::shared_log other{log_path};  // holds the log open while it is renamed
    for (long seq = 0; seq < 200; ++seq) (seq % 2 ? other : log).append(record_text(1, seq));
  }
  CHECK(fs::exists(log_path.string() + ".1"));
  CHECK(fs::exists(log_path.string() + ".2"));
  CHECK_FALSE(fs::exists(log_path.string() + ".3"));
  std::size_t names = 0;
  for (const auto& e : fs::directory_iterator{dir.path}) {
    ++names;
    INFO(e.path().filename().string());
    CHECK(e.path().filename().string().find("deleted") == std::string::npos);
  }
  CHECK(names == 4);  // the log, .1, .2 and the lock file
  // The newest records, in order, ending with the last.
  std::vector<long> seqs;
  for (const auto& f : {fs::path{log_path.string() + ".2"}, fs::path{log_path.string() + ".1"}, log_path})
    for (const auto& line : whole_lines(slurp(f))) {
      const auto r = parse_record(line);
      REQUIRE(r.first == 1);
      seqs.push_back(r.second);
    }
  REQUIRE_FALSE(seqs.empty());
  CHECK(seqs.back() == 199);
  for (std::size_t k = 1; k < seqs.size(); ++k) CHECK(seqs[k] == seqs[k - 1] + 1);
}

TEST_CASE("Windows shared_log: a holder terminated mid-write: its torn record is cut by the next holder, and appends that waited on it timed out naming it") {
  temp_dir dir;
  const auto log_path = dir.path / "torn.log";
  const auto ready = dir.path / "ready";
  child holder{{L"--log-torn", log_path.wstring(), ready.wstring()}};
  REQUIRE(wait_for_file(ready, 30s));
  {
    dibs::shared_log log{log_path, {.lock_timeout = 300ms}};
    const auto t0 = std::chrono::steady_clock::now();
    try {
      log.append("while held");
      FAIL("appended while another process held the lock");
    } catch (const std::system_error& e) {
      CHECK(e.code() == dibs::errc::timed_out);
      CHECK(dibs::is_transient(e.code()));
      const std::string m = e.what();
      INFO(m);
      CHECK(m.find(fmt::format("held by pid {}", holder.pi.dwProcessId)) != std::string::npos);
      CHECK(m.find("torn.log") != std::string::npos);
    }
    CHECK(std::chrono::steady_clock::now() - t0 >= 300ms);
    std::stop_source stop;
    stop.request_stop();
    std::error_code ec;
    try {
      log.append("cancelled", stop.get_token());
    } catch (const std::system_error& e) {
      ec = e.code();
    }
    CHECK(ec == dibs::errc::cancelled);
  }
  CHECK(slurp(log_path) == "before\ntorn-half-record");
  holder.kill();
  dibs::shared_log log{log_path};
  log.append("after");
  CHECK(slurp(log_path) == "before\nafter\n");
}

TEST_CASE("Windows shared_log: 2 logs x 4 threads of one process, none lost or torn") {
  temp_dir dir;
  const auto log_path = dir.path / "threads.log";
  dibs::shared_log a{log_path}, b{log_path};
  std::vector<std::thread> threads;
  for (long t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      for (long seq = 0; seq < 150; ++seq) (t % 2 ? a : b).append(record_text(t, seq));
    });
  for (auto& t : threads) t.join();
  std::set<std::pair<long, long>> seen;
  std::size_t bad = 0;
  for (const auto& line : whole_lines(slurp(log_path))) {
    const auto r = parse_record(line);
    if (r.first < 0 || !seen.insert(r).second) ++bad;
  }
  CHECK(bad == 0);
  CHECK(seen.size() == 8 * 150);
}

TEST_CASE("Windows shared_log: a missing directory, a directory as the log, a read-only log: errors naming the path") {
  temp_dir dir;
  const auto m1 = message_of(dir.path / "nowhere" / "a.log");
  INFO(m1);
  CHECK(m1.find("nowhere") != std::string::npos);
  CHECK(m1.find("does the directory exist?") != std::string::npos);
  fs::create_directory(dir.path / "adir");
  const auto m2 = message_of(dir.path / "adir");
  INFO(m2);
  CHECK(m2.find("adir") != std::string::npos);
  CHECK(m2.find("not a regular file") != std::string::npos);
  const auto ro = dir.path / "ro.log";
  std::ofstream{ro, std::ios::binary} << "old\n";
  REQUIRE(::SetFileAttributesW(ro.c_str(), FILE_ATTRIBUTE_READONLY));
  const auto m3 = message_of(ro);
  ::SetFileAttributesW(ro.c_str(), FILE_ATTRIBUTE_NORMAL);
  INFO(m3);
  CHECK(m3.find("ro.log") != std::string::npos);
  CHECK(m3.find("read-only") != std::string::npos);
  CHECK(slurp(ro) == "old\n");
  // A lock file that is not a shared_log's.
  std::ofstream{dir.path / ".other.log.dibs-lock"} << "something else entirely, longer than the state's 64 bytes....\n";
  const auto m4 = message_of(dir.path / "other.log");
  INFO(m4);
  CHECK(m4.find(".other.log.dibs-lock") != std::string::npos);
  CHECK(m4.find("not a dibs shared_log lock file") != std::string::npos);
}

TEST_CASE("Windows shared_log: per_record and per_batch durability (FlushFileBuffers) with rotations, every record once and in order") {
  temp_dir dir;
  const auto log_path = dir.path / "durable.log";
  {
    dibs::shared_log per_record{log_path, {.rotate_size = 500, .sync = dibs::durability::per_record}};
    dibs::shared_log per_batch{log_path, {.rotate_size = 500, .sync = dibs::durability::per_batch, .batch_records = 3}};
    for (long seq = 0; seq < 40; ++seq) (seq % 2 ? per_batch : per_record).append(record_text(1, seq));
    per_batch.flush();  // its log was rotated since its last record: flushed through a handle opened now
    per_record.flush();
  }
  std::uint64_t n = 1;
  while (fs::exists(log_path.string() + "." + std::to_string(n))) ++n;
  CHECK(n > 3);
  std::vector<long> seqs;
  for (std::uint64_t k = n - 1; k >= 1; --k)
    for (const auto& line : whole_lines(slurp(log_path.string() + "." + std::to_string(k)))) seqs.push_back(parse_record(line).second);
  for (const auto& line : whole_lines(slurp(log_path))) seqs.push_back(parse_record(line).second);
  REQUIRE(seqs.size() == 40);
  for (long k = 0; k < 40; ++k) CHECK(seqs[static_cast<std::size_t>(k)] == k);
}

}  // namespace shared_log_win_test
