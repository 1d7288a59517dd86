// The proof rule on Windows (detail/owner.hpp, detail/win32/process.hpp): a
// holder is judged gone only on proof (same computer, same boot, and its
// process id free, or taken by a process created at another time, or its
// process exited), never because something could not be read.
#include "win_support.hpp"

#include <dibs/detail/owner.hpp>

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>

namespace owner_win_test {
namespace {

using namespace win_test;

// The sleeping role: waits until it is terminated (at most 2 minutes).
const register_role sleep_role{"--sleep", [](int, char**) {
  ::Sleep(120'000);
  return 0;
}};

// Returns: an owner record of process `c`, on this computer in this boot.
dibs::detail::owner_id owner_of(const child& c) {
  dibs::detail::owner_id o = dibs::detail::this_process(30s);
  o.pid = static_cast<long>(c.pi.dwProcessId);
  o.start = dibs::detail::process_start(o.pid).value_or(0);
  return o;
}

}  // namespace

TEST_CASE("Windows proof rule: this process is named by computer, boot time, id and creation time, read alike every time") {
  const auto& me = dibs::detail::this_process_base();
  CHECK(me.host == dibs::detail::host_name());
  CHECK_FALSE(me.host.empty());
  CHECK(me.boot.size() > 37);  // MachineGuid (36 characters), '-', the boot time
  CHECK(me.boot.substr(0, 36) == dibs::detail::machine_guid());
  CHECK(dibs::detail::boot_id() == me.boot);
  CHECK(me.pid == static_cast<long>(::GetCurrentProcessId()));
  CHECK(me.start != 0);
  CHECK(dibs::detail::process_start(me.pid) == me.start);
  CHECK(me.pid_ns == 0);  // Windows has no PID namespaces
  CHECK_FALSE(dibs::detail::provably_dead(me));
  // The record round-trips through its text.
  CHECK(dibs::detail::parse_owner(dibs::detail::format_owner(dibs::detail::this_process(5s))) == dibs::detail::this_process(5s));
}

TEST_CASE("Windows proof rule: the boot time is one that no step of the clock moves (BootTime minus BootTimeBias)") {
  // Windows adds every step of the clock to both BootTime and BootTimeBias.
  // Wine's clock is never stepped, so the step is made here, in the
  // structure NtQuerySystemInformation fills: a boot at T, read before any
  // step and after steps of +3 hours and then -1 hour, is T every time.
  constexpr std::int64_t boot = 134'000'000'000'000'000;  // 100 ns since 1601: in 2025
  constexpr std::int64_t hour = 36'000'000'000;
  auto info_after = [](std::int64_t steps) {
    std::array<unsigned char, 48> info{};
    const std::int64_t boot_time = boot + steps;
    const std::uint64_t bias = static_cast<std::uint64_t>(steps);
    std::memcpy(info.data(), &boot_time, 8);
    std::memcpy(info.data() + 32, &bias, 8);
    return info;
  };
  CHECK(dibs::detail::boot_time_of(info_after(0).data(), 48) == boot);
  CHECK(dibs::detail::boot_time_of(info_after(3 * hour).data(), 48) == boot);
  CHECK(dibs::detail::boot_time_of(info_after(2 * hour).data(), 48) == boot);
  CHECK(dibs::detail::boot_time_of(info_after(-hour).data(), 48) == boot);
  CHECK(dibs::detail::boot_time_of(info_after(0).data(), 39) == 0);  // too short to hold the bias: unknown
}

TEST_CASE("Windows proof rule: a running process is alive, and once terminated it is gone, both while a handle keeps its object and after") {
  child c{{L"--sleep"}};
  const auto o = owner_of(c);
  REQUIRE(o.start != 0);
  CHECK_FALSE(dibs::detail::provably_dead(o));
  CHECK_FALSE(dibs::detail::pid_absent(o.pid));

  c.kill();  // c still holds a handle: the process object (and its id) stay, with an exit code
  CHECK(dibs::detail::provably_dead(o));

  ::CloseHandle(c.pi.hProcess);
  ::CloseHandle(c.pi.hThread);
  c.pi.hProcess = c.pi.hThread = nullptr;
  CHECK(dibs::detail::provably_dead(o));  // no such id now (or a later process's, created at another time)
}

TEST_CASE("Windows proof rule: a live process under another creation time is a reused id (gone), and there is no proof without host, boot or creation time") {
  child c{{L"--sleep"}};
  const auto alive = owner_of(c);
  REQUIRE(alive.start != 0);

  auto reused = alive;  // the record of an earlier process that had this id
  reused.start = alive.start - 10'000'000;
  CHECK(dibs::detail::provably_dead(reused));

  auto unknown_start = alive;  // its creation time could not be read: a running process with the id is alive
  unknown_start.start = 0;
  CHECK_FALSE(dibs::detail::provably_dead(unknown_start));

  auto other_host = reused;
  other_host.host += "-other";
  CHECK_FALSE(dibs::detail::provably_dead(other_host));

  auto other_boot = reused;
  other_boot.boot = dibs::detail::machine_guid() + "-1";
  CHECK_FALSE(dibs::detail::provably_dead(other_boot));

  auto no_boot = reused;
  no_boot.boot.clear();
  CHECK_FALSE(dibs::detail::provably_dead(no_boot));

  // Our own id under another creation time: an earlier process with our id.
  auto earlier_me = dibs::detail::this_process(30s);
  earlier_me.start -= 1;
  CHECK(dibs::detail::provably_dead(earlier_me));
}

TEST_CASE("Windows proof rule: an id no process has is absent and gone") {
  const long free_id = free_process_id();
  REQUIRE(free_id != 0);
  auto o = dibs::detail::this_process(30s);
  o.pid = free_id;
  o.start = 12345;
  CHECK(dibs::detail::provably_dead(o));
  CHECK_THROWS_WITH(dibs::detail::other_process(30s, free_id, "test"),
                    Catch::Contains(fmt::format("on_behalf_of names pid {}, which does not exist", free_id)));
}

}  // namespace owner_win_test
