// dibs/detail/win32/process.hpp: what one process can learn about another
// on Windows, for the proof rule in detail/owner.hpp; the twin of
// detail/posix/process.hpp. Whatever cannot be read is reported as unknown
// (0, nullopt, false, ""), never as an answer: the rule counts the unknown
// as alive.
//
//   - The host is the computer name (win32/sys.hpp), the boot the
//     installation's MachineGuid and the time the machine booted (100 ns
//     since 1601, from NtQuerySystemInformation(SystemTimeOfDayInformation)):
//     a time, not a counter that wraps (GetTickCount wraps after 49 days),
//     and an id that tells apart machines cloned with one computer name, or
//     Wine prefixes (each has its own wineserver, process ids and boot time)
//     that started in the same second. The boot time is BootTime minus
//     BootTimeBias: Windows moves BootTime by every step of the clock (the
//     time service's corrections, a user setting the time) and adds the
//     same step to BootTimeBias, so BootTime alone would change while the
//     machine runs and every live holder would look like one of another
//     boot; the difference stays the time the machine really booted.
//   - A process is named by its id and its creation time (GetProcessTimes,
//     100 ns since 1601): Windows reuses ids, never creation times of one id.
//   - There are no PID namespaces: an id is unique on the machine across
//     sessions (Remote Desktop, services), so pid_ns and time_ns stay 0.
//
// Verified under Wine 8: a terminated process is gone (no such id, or an
// exit code), a live one is alive, the boot time is stable within one
// wineserver. Not verified under Wine: processes of other users and
// sessions (OpenProcess refused for lack of rights counts as alive).
#pragma once

#include <dibs/detail/process_identity.hpp>
#include <dibs/detail/win32/sys.hpp>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

namespace dibs::detail {

inline std::uint64_t filetime_ticks(const FILETIME& t) noexcept {
  return (static_cast<std::uint64_t>(t.dwHighDateTime) << 32) | t.dwLowDateTime;
}

/// Returns: the creation time of the process behind `h`, or nullopt.
inline std::optional<std::uint64_t> creation_time(HANDLE h) noexcept {
  FILETIME created{}, exited{}, kernel{}, user{};
  if (!::GetProcessTimes(h, &created, &exited, &kernel, &user)) return std::nullopt;
  const std::uint64_t t = filetime_ticks(created);
  if (t == 0) return std::nullopt;
  return t;
}

/// Returns: a handle for querying process `pid` (none if it cannot be
/// opened: GetLastError() says why; ERROR_INVALID_PARAMETER means there is
/// no process with that id).
inline unique_handle open_process(long pid) noexcept {
  return unique_handle{::OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, FALSE, static_cast<DWORD>(pid))};
}

/// Returns: the creation time of process `pid`, or nullopt if it cannot be
/// read (no such process, or no right to open it).
inline std::optional<std::uint64_t> process_start(long pid) {
  const unique_handle h = open_process(pid);
  if (!h) return std::nullopt;
  return creation_time(h.get());
}

/// Returns: true only if no process has the id `pid` here.
inline bool pid_absent(long pid) noexcept {
  if (pid <= 0) return false;
  const unique_handle h = open_process(pid);
  return !h && ::GetLastError() == ERROR_INVALID_PARAMETER;
}

/// Returns: this Windows installation's id (the registry's MachineGuid,
/// made once per installation; under Wine, per prefix), or "".
inline std::string machine_guid() {
  wchar_t buf[64] = {};
  DWORD size = sizeof buf;
  if (::RegGetValueW(HKEY_LOCAL_MACHINE, L"SOFTWARE\\Microsoft\\Cryptography", L"MachineGuid",
                     RRF_RT_REG_SZ | RRF_SUBKEY_WOW6464KEY, nullptr, buf, &size) != ERROR_SUCCESS)
    return {};
  std::string out;
  for (const wchar_t* c = buf; *c; ++c) {
    if (*c >= L'A' && *c <= L'F') out += static_cast<char>(*c - L'A' + 'a');
    else if ((*c >= L'a' && *c <= L'f') || (*c >= L'0' && *c <= L'9') || *c == L'-') out += static_cast<char>(*c);
    else return {};  // not a GUID: cannot vouch for it
  }
  return out;
}

/// Returns: this boot of this installation, as text ("" if it cannot be
/// read): its MachineGuid and the time it booted (100 ns since 1601), so
/// that two machines (or two Wine prefixes, each with its own wineserver
/// and process ids) that booted in the same second never look alike. A pid
/// or a creation time means something only within one boot.
/// Returns: the boot time in `info`, a SYSTEM_TIMEOFDAY_INFORMATION of
/// `got` bytes, that no step of the clock moves (BootTime - BootTimeBias);
/// 0 if `info` is too short to hold it.
inline std::int64_t boot_time_of(const unsigned char* info, std::size_t got) {
  // The layout: BootTime, CurrentTime, TimeZoneBias (8 bytes each),
  // TimeZoneId, Reserved (4 each), BootTimeBias, SleepTimeBias (8 each).
  constexpr std::size_t bias_at = 32;
  if (got < bias_at + 8) return 0;
  std::int64_t boot = 0;
  std::uint64_t bias = 0;
  std::memcpy(&boot, info, sizeof boot);
  std::memcpy(&bias, info + bias_at, sizeof bias);
  return static_cast<std::int64_t>(static_cast<std::uint64_t>(boot) - bias);
}

inline std::string boot_id() {
  using query_fn = LONG(WINAPI*)(int, void*, ULONG, ULONG*);
  const HMODULE ntdll = ::GetModuleHandleW(L"ntdll.dll");
  if (!ntdll) return {};
  // GetProcAddress returns a generic function pointer; the documented
  // signature of NtQuerySystemInformation is restored here.
  const auto query = reinterpret_cast<query_fn>(reinterpret_cast<void*>(::GetProcAddress(ntdll, "NtQuerySystemInformation")));
  if (!query) return {};
  // SYSTEM_TIMEOFDAY_INFORMATION (class 3), 100 ns since 1601.
  unsigned char info[48] = {};
  ULONG got = 0;
  if (query(3, info, sizeof info, &got) != 0) return {};
  const std::int64_t boot = boot_time_of(info, got);
  const std::string machine = machine_guid();
  if (boot <= 0 || machine.empty()) return {};
  return fmt::format("{}-{}", machine, boot);
}

/// Returns: this process's identity: its id and creation time.
inline process_identity own_process() {
  return {static_cast<long>(::GetCurrentProcessId()), creation_time(::GetCurrentProcess()).value_or(0), 0, 0};
}

/// Returns: true: a process id is unique on the machine, and any process's
/// creation time can be read where it can be opened.
inline bool own_pids_readable(long) { return true; }

/// Returns: true only on proof that process `p`, which ran on this machine
/// in this boot, is gone, judged by `me` (this process's identity): no
/// process has its id; or the process with its id has exited (its exit code
/// is set: the process object lives on while handles to it are open); or
/// one runs with that id but was created at another time (the id was
/// reused). A process that cannot be opened for lack of rights is alive.
inline bool process_gone(const process_identity& p, const process_identity& me, bool) {
  if (p.pid <= 0) return false;
  if (p.pid == me.pid)  // our own id: that was us, or an earlier process with our id
    return p.start != 0 && me.start != 0 && p.start != me.start;
  const unique_handle h = open_process(p.pid);
  if (!h) return ::GetLastError() == ERROR_INVALID_PARAMETER;
  DWORD code = 0;
  if (::GetExitCodeProcess(h.get(), &code) && code != STILL_ACTIVE) return true;
  if (p.start == 0) return false;
  const auto created = creation_time(h.get());
  return created && *created != p.start;
}

}  // namespace dibs::detail
