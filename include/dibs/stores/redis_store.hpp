// dibs/stores/redis_store.hpp: records in a Redis server (7.0 or later;
// target dibs::redis, which links hiredis).
//
// Every record is a hash under the store's namespace N, in one hash slot
// (the tag {N}), so that a Redis Cluster keeps a namespace's records, its
// version counter and its index on one node and a script may touch them
// together:
//
//   {N}:r:KEY   the record: v (version), d (value), t (the server's clock, ms,
//               at the last write)
//   {N}:seq     the version counter: every write takes the next number (INCR
//               in the write's own script), so versions only grow, across
//               erase and create too, and serve as fencing tokens
//   {N}:keys    a sorted set of the live keys (keys(prefix) reads a range of
//               it: an index, not a SCAN)
//
// Each write is one server-side script (EVALSHA) that checks the version,
// takes the counter and writes, then PUBLISHes on the key's channel
// ({N}:c:KEY), which wait_for_change() listens on: waiters wake when the
// record changes, without polling. Leases are judged by the server's clock
// (TIME, in the scripts): store_with_clock, store_with_wall_clock.
//
// The protocol is hiredis's (its command formatting and reply reader); the
// connection is dibs's own socket layer (detail/tcp.hpp), so that every
// operation has a deadline, a server that went away is an error and never
// SIGPIPE, and a forked child never writes to its parent's connection.
//
// A write whose reply was lost (the connection broke after the command was
// sent) is errc::outcome_unknown: the next command on that connection's
// place first ends the old connection on the server (CLIENT KILL ID), after
// which its command either ran or never will, and the policies then read
// the record back (store.hpp). The guarantees under the server's settings
// (appendfsync, replicas, failover) are in docs/stores.md.
//
// Thread safety: as postgres_store: each thread that calls the store is
// given one of `sessions` connections at its first call; renewals have
// their own.
#pragma once

#ifdef _WIN32
#error "dibs/stores/redis_store.hpp is not ported to Windows yet (Debian has no hiredis for mingw-w64); docs/windows.md lists the headers that are"
#endif

#include <hiredis/hiredis.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <dibs/detail/claim_record.hpp>
#include <dibs/detail/renewal_keeper.hpp>
#include <dibs/detail/tcp.hpp>
#include <dibs/error.hpp>
#include <dibs/store.hpp>

namespace dibs {

struct redis_store_options {
  /// The namespace of the store's keys in the server: letters, digits and
  /// '_', '-', '.', at most 64 characters. Stores with the same namespace
  /// on one server share their records.
  std::string ns = "dibs";
  /// How long connecting, and each reply, may take: a server that stopped
  /// answering (a cut network, a frozen host) is noticed after this.
  std::chrono::milliseconds timeout{10'000};
  /// Connections the store's operations use at most (besides the renewals'
  /// and the waiters'), given out to threads as postgres_store's sessions.
  std::size_t sessions = 4;
  /// Refuse a server whose append-only file is not fsync'd on every write
  /// (appendonly yes, appendfsync always), checked at connect: what a lock
  /// or claim that must survive a crash of the server's machine needs.
  bool require_fsync_always = false;
  /// Replicas each write must have reached before it counts (WAIT after
  /// every write): 0, the default, waits for none. A write that reached
  /// fewer within `replica_timeout` is errc::outcome_unknown: it is on the
  /// primary, and a failover to a replica that lacks it would lose it (see
  /// docs/stores.md, redis_store: what the server's settings give).
  int replicas = 0;
  std::chrono::milliseconds replica_timeout{2000};
};

class redis_store {
public:
  /// Effects: connects to the server named by `url`:
  /// redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] (PASSWORD percent-decoded;
  /// PORT 6379 and DB 0 if absent).
  /// Throws: std::system_error naming the server: it cannot be reached
  /// (transient), refuses the password (std::errc::permission_denied), is
  /// not a Redis server, or its append-only file is not fsync'd always and
  /// opts.require_fsync_always asks for it; a bad URL or namespace
  /// (errc::invalid_argument).
  explicit redis_store(std::string url = "redis://127.0.0.1:6379", redis_store_options opts = {})
      : opts_(std::move(opts)) {
    parse_url(url);
    validate_ns(opts_.ns);
    if (opts_.sessions == 0 || opts_.sessions > 64)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::redis_store: sessions must be 1 to 64 (got {})", opts_.sessions));
    if (opts_.replicas < 0 || opts_.replicas > 100 || opts_.replica_timeout.count() < 1)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::redis_store: replicas must be 0 to 100 and replica_timeout at least "
                                          "1 ms (got {} and {} ms)",
                                          opts_.replicas, opts_.replica_timeout.count()));
    tag_ = "{" + opts_.ns + "}";
    for (std::size_t i = 0; i < opts_.sessions; ++i) sessions_.push_back(std::make_unique<connection>());
    connection& first = current();
    std::lock_guard g{first.m};
    connect(first, deadline(time_limit::max()));
    if (opts_.require_fsync_always) check_fsync(first);
  }
  redis_store(const redis_store&) = delete;
  redis_store& operator=(const redis_store&) = delete;
  ~redis_store() {
    for (const auto& c : sessions_) c->close();
    renewals_.close();
    listener_.close();
    offers_.close();
  }

  std::optional<record> read(std::string_view key) { return read(key, time_limit::max()); }
  std::optional<record> read(std::string_view key, time_limit t) {
    validate_key(key, "dibs::redis_store::read");
    const auto r = run({"HMGET", rec_key(key), "v", "d"}, t, false, "read", key);
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2) bad_reply("read", key);
    if (r->element[0]->type != REDIS_REPLY_STRING) return std::nullopt;
    return record{text(r->element[1]), number(r->element[0], "read", key)};
  }

  /// Returns: the record and how long ago, by the server's clock, it was
  /// last written (store_with_clock).
  std::optional<aged_record> read_aged(std::string_view key, time_limit t = time_limit::max()) {
    validate_key(key, "dibs::redis_store::read_aged");
    const auto r = script(script_id::read_aged, {rec_key(key)}, {}, t, false, "read", key);
    if (r->type != REDIS_REPLY_ARRAY) return std::nullopt;
    if (r->elements != 3) bad_reply("read", key);
    return aged_record{record{text(r->element[1]), number(r->element[0], "read", key)},
                       std::chrono::milliseconds{static_cast<std::int64_t>(number(r->element[2], "read", key))}};
  }

  /// Returns: the server's wall clock (TIME), to the millisecond: one clock
  /// for every client (store_with_wall_clock).
  std::chrono::system_clock::time_point now(time_limit t = time_limit::max()) {
    const auto r = run({"TIME"}, t, false, "read the server's clock", {});
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2) bad_reply("read the server's clock", {});
    const auto s = number(r->element[0], "TIME", {}), us = number(r->element[1], "TIME", {});
    return std::chrono::system_clock::time_point{
        std::chrono::milliseconds{static_cast<std::int64_t>(s * 1000 + us / 1000)}};
  }

  std::optional<dibs::version> create(std::string_view key, std::string_view value) {
    return create(key, value, time_limit::max());
  }
  std::optional<dibs::version> create(std::string_view key, std::string_view value, time_limit t) {
    validate_key(key, "dibs::redis_store::create");
    validate_value(key, value);
    const auto r = write(key, "c", "0", value, t, "create");
    if (r->type != REDIS_REPLY_INTEGER) return std::nullopt;
    return static_cast<dibs::version>(r->integer);
  }

  /// For marker_claim's try_claim (dibs::create_or_read_store): creates the
  /// record of `key` if it has none, else returns the one it has, in one
  /// script. Returns: `created`, or `existing`.
  create_or_read_result create_or_read(std::string_view key, std::string_view value, time_limit t = time_limit::max()) {
    validate_key(key, "dibs::redis_store::create_or_read");
    validate_value(key, value);
    const auto r = write(key, "o", "0", value, t, "create");
    if (r->type == REDIS_REPLY_INTEGER) return {static_cast<dibs::version>(r->integer), std::nullopt};
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2) bad_reply("create", key);
    return {std::nullopt, record{text(r->element[1]), number(r->element[0], "create", key)}};
  }

  std::optional<dibs::version> replace(std::string_view key, dibs::version expected, std::string_view value) {
    return replace(key, expected, value, time_limit::max());
  }
  std::optional<dibs::version> replace(std::string_view key, dibs::version expected, std::string_view value,
                                       time_limit t) {
    validate_key(key, "dibs::redis_store::replace");
    validate_value(key, value);
    const auto r = write(key, "r", std::to_string(expected), value, t, "replace");
    if (r->type != REDIS_REPLY_INTEGER) return std::nullopt;
    return static_cast<dibs::version>(r->integer);
  }

  bool erase(std::string_view key, dibs::version expected) { return erase(key, expected, time_limit::max()); }
  bool erase(std::string_view key, dibs::version expected, time_limit t) {
    validate_key(key, "dibs::redis_store::erase");
    const auto r = write(key, "e", std::to_string(expected), {}, t, "erase");
    return r->type == REDIS_REPLY_INTEGER;
  }

  /// For marker_claim's offer_n (dibs::batch_store): creates each absent
  /// key as create() does, all in one script (atomic). Returns: per item its
  /// version, or nothing if the key had a record.
  std::vector<std::optional<dibs::version>> create_n(std::span<const key_value> items, time_limit t = time_limit::max()) {
    detail::check_batch(items, "dibs::redis_store::create_n");
    std::vector<std::string> keys{seq_key(), index_key()}, args{tag_};
    for (const auto& it : items) {
      keys.push_back(rec_key(it.key));
      args.emplace_back(it.key);
      args.emplace_back("0");
      args.emplace_back(it.value);
    }
    return per_item(script(script_id::write_n, keys, args, t, true, "create a batch of records", {}), items.size(),
                    "create a batch of records");
  }

  /// For marker_claim's complete_n (dibs::batch_store): each item's
  /// compare-and-set as replace() does it, all in one script. Returns: per
  /// item its new version, or nothing if its version had moved.
  std::vector<std::optional<dibs::version>> replace_n(std::span<const replace_item> items,
                                                      time_limit t = time_limit::max()) {
    detail::check_batch(items, "dibs::redis_store::replace_n");
    std::vector<std::string> keys{seq_key(), index_key()}, args{tag_};
    for (const auto& it : items) {
      keys.push_back(rec_key(it.key));
      args.emplace_back(it.key);
      args.push_back(std::to_string(it.expected));
      args.emplace_back(it.value);
    }
    return per_item(script(script_id::write_n, keys, args, t, true, "replace a batch of records", {}), items.size(),
                    "replace a batch of records");
  }

  /// For marker_claim::claim_next and claim_next_n (dibs::claim_queue_store):
  /// in one script, claims up to `n` claimable items whose key starts with
  /// `prefix` (offered or released, their not_before come by the server's
  /// clock), the highest priority first, then in key order, through the
  /// queue's indexes (a range of a sorted set per priority: the cost does not
  /// grow with the items done or waiting); each one's new value is the
  /// processing head with the attempt counted and its priority kept, then
  /// `rest`. Returns: their keys and new records, in that order.
  std::vector<std::pair<std::string, record>> take_claimable(std::string_view prefix, std::string_view rest,
                                                             std::uint32_t n, time_limit t = time_limit::max()) {
    validate_value(prefix, rest);
    const auto [min, max] = lex_range(prefix);
    const auto r = script(script_id::take, {seq_key()}, {tag_, min, max, std::to_string(std::max<std::uint32_t>(n, 1)), std::string(rest)},
                          t, true, "claim the next item", {});
    if (r->type != REDIS_REPLY_ARRAY || r->elements % 4 != 0) bad_reply("claim the next item", {});
    std::vector<std::pair<std::string, record>> out;
    out.reserve(r->elements / 4);
    for (std::size_t i = 0; i < r->elements; i += 4) {
      const auto attempts = number(r->element[i + 2], "claim the next item", {});
      std::int64_t priority = 0;
      const auto p = text(r->element[i + 3]);
      (void)std::from_chars(p.data(), p.data() + p.size(), priority);
      out.emplace_back(text(r->element[i]),
                       record{detail::claim_record::taken_head(attempts, priority) + std::string(rest),
                              number(r->element[i + 1], "claim the next item", {})});
    }
    return out;
  }

  /// For marker_claim's sweeps (dibs::claim_queue_store). Returns: the keys
  /// that start with `prefix` whose record is a processing claim (from the
  /// index of processing claims).
  std::vector<std::string> processing_keys(std::string_view prefix = {}) {
    return lex_list(tag_ + ":p", prefix, "list claims in progress");
  }

  /// For dibs::worker_pool: blocks until a write of any process made an
  /// item claimable now (the scripts PUBLISH on {N}:offered) or `timeout`
  /// passes. The first wait subscribes and returns true at once (look
  /// again). Returns: true if an offer was seen, or may have been missed.
  bool wait_for_offer(std::chrono::nanoseconds timeout) const {
    return offers_.wait(*this, tag_ + ":offered", timeout);
  }

  /// Returns: the keys of the live records that start with `prefix`, from
  /// the store's index of keys (a range of a sorted set, read in pages).
  std::vector<std::string> keys(std::string_view prefix = {}) {
    auto [min, max] = lex_range(prefix);
    std::vector<std::string> out;
    for (;;) {
      // {scanned, last scanned, live keys...}: a key whose hash is gone (a
      // person's DEL) is dropped from the index as it is met.
      const auto r = script(script_id::keys, {index_key()}, {tag_ + ":r:", min, max, "1000"}, time_limit::max(),
                            false, "list keys", {});
      if (r->type != REDIS_REPLY_ARRAY || r->elements < 2) bad_reply("list keys", {});
      for (std::size_t i = 2; i < r->elements; ++i) out.push_back(text(r->element[i]));
      if (number(r->element[0], "list keys", {}) < 1000) return out;
      min = "(" + text(r->element[1]);
    }
  }

  /// Effects: blocks until the record of `key` changes (the write scripts
  /// PUBLISH on its channel) or `timeout` passes. The first wait for a key
  /// subscribes to its channel and returns true at once: a change just
  /// before it could not be seen, so the caller reads again; so does a wait
  /// whose listening connection was lost and opened again.
  /// Returns: true if a change was seen, or may have been missed.
  bool wait_for_change(std::string_view key, std::chrono::nanoseconds timeout) const {
    return listener_.wait(*this, channel(key), timeout);
  }

  const std::string& ns() const noexcept { return opts_.ns; }
  /// Returns: "host:port/db" of the server, for messages.
  const std::string& server() const noexcept { return server_; }
  /// Returns: "namespace 'N' on redis host:port/db", for messages.
  std::string where() const { return fmt::format("namespace '{}' on redis {}", opts_.ns, server_); }

  /// Throws: errc::invalid_argument naming `ns` if it is not a namespace
  /// this store takes.
  static void validate_ns(std::string_view ns) {
    const bool ok = !ns.empty() && ns.size() <= 64 && std::all_of(ns.begin(), ns.end(), [](char c) {
      return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
             c == '.';
    });
    if (!ok)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::redis_store: invalid namespace '{}': 1 to 64 letters, digits, '_', "
                                          "'-' or '.'",
                                          show_key(ns)));
  }

private:
  struct reply_free {
    void operator()(redisReply* r) const noexcept { ::freeReplyObject(r); }
  };
  using reply = std::unique_ptr<redisReply, reply_free>;
  struct reader_free {
    void operator()(redisReader* r) const noexcept { ::redisReaderFree(r); }
  };

  // One connection: a socket, hiredis's reply reader, and the server's id
  // of it (CLIENT ID), so that one whose reply was lost can be ended.
  struct connection {
    std::mutex m;
    detail::socket_handle fd = detail::no_socket;
    detail::socket_pid owner = 0;
    std::unique_ptr<redisReader, reader_free> reader;
    std::string id, addr;  // the server's names of it (CLIENT INFO)
    struct {
      std::string id, addr;
    } lost;  // a connection of this one's place whose write's reply was lost: ended before anything else
    void close() noexcept {
      if (fd != detail::no_socket && owner == detail::socket_owner()) detail::close_socket(fd);
      fd = detail::no_socket;
      reader.reset();
    }
    bool open() const noexcept { return fd != detail::no_socket && owner == detail::socket_owner(); }
  };

  enum class script_id { write, write_n, read_aged, keys, take, count };

  // The scripts. Versions come from {N}:seq; TIME is the server's clock (a
  // script may call it: Redis 7 replicates a script's effects, not the
  // script). Every write keeps the queue's indexes (queue_lua) in step with
  // the record, as postgres_store's trigger keeps its columns:
  //   {N}:qp       the priorities that have claimable keys (score -priority)
  //   {N}:q:P      the claimable keys of priority P (score 0: key order)
  //   {N}:qk       key -> P, where it is queued
  //   {N}:d        offered or released keys whose not_before is still to
  //                come (score: not_before, ms); take moves them to {N}:q:P
  //   {N}:p        the processing claims (score 0), for processing_keys()
  // A record's head is read as detail/claim_record.hpp's parse_head()
  // reads it; the test compares the two.
  static constexpr std::string_view queue_lua = R"lua(
local function num(x) return string.format('%.0f', x) end
local function head(v)
  if not v or string.sub(v, 1, 13) ~= 'dibs-claim 1\n' then return nil end
  local state = string.match(v, '^state ([a-z]+)\n', 14)
  if not state or #state > 20 then return nil end
  local h = {state = state}
  local a = string.match(v, '^attempts (%d+)\n', 14 + 7 + #state)
  if a and #a <= 9 then h.attempts = tonumber(a) end
  local p = string.match(v, '\npriority (%-?%d+)\n', 13)
  if p and #string.gsub(p, '-', '') <= 18 then h.prio = num(tonumber(p)) else h.prio = '0' end
  local nb = string.match(v, '\nnot_before (%d+)\n', 13)
  if nb and #nb <= 18 then h.nb = tonumber(nb) end
  return h
end
local function waiting(h) return h and (h.state == 'offered' or h.state == 'released') and h.attempts end
local offered = false
local function queue(tag, key, prio)
  redis.call('ZADD', tag .. ':q:' .. prio, 0, key)
  redis.call('HSET', tag .. ':qk', key, prio)
  redis.call('ZADD', tag .. ':qp', -tonumber(prio), prio)
  offered = true
end
local function unindex(tag, key)
  local p = redis.call('HGET', tag .. ':qk', key)
  if p then
    redis.call('ZREM', tag .. ':q:' .. p, key)
    redis.call('HDEL', tag .. ':qk', key)
    if redis.call('ZCARD', tag .. ':q:' .. p) == 0 then redis.call('ZREM', tag .. ':qp', p) end
  end
  redis.call('ZREM', tag .. ':d', key)
  redis.call('ZREM', tag .. ':p', key)
end
-- Takes `key` out of the indexes its previous value `old` put it in: a
-- processing claim is in {N}:p, a waiting one in the queue's; any other
-- record (nil: none before) in none. (A hash a person deleted by hand
-- leaves its entries behind: take() and the sweeps drop those they meet.)
local function unindex_old(tag, key, old)
  local h = head(old)
  if not h then return end
  if h.state == 'processing' then redis.call('ZREM', tag .. ':p', key)
  elseif waiting(h) then unindex(tag, key) end
end
local function index(tag, key, v, now, old)
  unindex_old(tag, key, old)
  local h = head(v)
  if waiting(h) then
    if h.nb and h.nb > now then redis.call('ZADD', tag .. ':d', h.nb, key) else queue(tag, key, h.prio) end
  elseif h and h.state == 'processing' then
    redis.call('ZADD', tag .. ':p', 0, key)
  end
end
local function told(tag) if offered then redis.call('PUBLISH', tag .. ':offered', '1') end end
local function clock()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end
)lua";
  // KEYS: the record, seq, the key index; ARGV: mode (c create, o create
  // or read, r replace, e erase), the expected version, the value, the key,
  // its channel, the tag.
  static constexpr std::string_view write_lua = R"lua(
local r = redis.call('HMGET', KEYS[1], 'v', 'd')
local cur, old = r[1], r[2]
local mode = ARGV[1]
local tag = ARGV[6]
if mode == 'c' or mode == 'o' then
  if cur then
    if mode == 'o' then return {cur, old} end
    return false
  end
elseif cur ~= ARGV[2] then
  return false
end
if mode == 'e' then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[3], ARGV[4])
  unindex_old(tag, ARGV[4], old)
  redis.call('PUBLISH', ARGV[5], 'e')
  return 1
end
local now = clock()
local v = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'v', num(v), 'd', ARGV[3], 't', num(now))
if not cur then redis.call('ZADD', KEYS[3], 0, ARGV[4]) end
index(tag, ARGV[4], ARGV[3], now, old)
redis.call('PUBLISH', ARGV[5], 'w')
told(tag)
return v
)lua";
  // KEYS: seq, the key index, then each item's record; ARGV: the tag, then
  // per item key, expected version ('0': create) and value. Every item is
  // checked before any is written; the items that lost their race are 0.
  static constexpr std::string_view write_n_lua = R"lua(
local n = #KEYS - 2
local tag = ARGV[1]
local ok, old = {}, {}
for i = 1, n do
  local r = redis.call('HMGET', KEYS[i + 2], 'v', 'd')
  local cur = r[1]
  old[i] = r[2]
  local want = ARGV[3 * i]
  if want == '0' then ok[i] = not cur else ok[i] = (cur == want) end
end
local now = clock()
local out = {}
for i = 1, n do
  if ok[i] then
    local key = ARGV[3 * i - 1]
    local v = redis.call('INCR', KEYS[1])
    redis.call('HSET', KEYS[i + 2], 'v', num(v), 'd', ARGV[3 * i + 1], 't', num(now))
    if ARGV[3 * i] == '0' then redis.call('ZADD', KEYS[2], 0, key) end
    index(tag, key, ARGV[3 * i + 1], now, old[i])
    redis.call('PUBLISH', tag .. ':c:' .. key, 'w')
    out[i] = v
  else
    out[i] = 0
  end
end
told(tag)
return out
)lua";
  // KEYS: seq; ARGV: the tag, the key range (ZRANGEBYLEX min and max), how
  // many, the rest of the record. Returns per claim: key, version,
  // attempts, priority.
  static constexpr std::string_view take_lua = R"lua(
local tag = ARGV[1]
local now = clock()
local due = redis.call('ZRANGEBYSCORE', tag .. ':d', '-inf', now, 'LIMIT', 0, 1000)
for _, k in ipairs(due) do
  redis.call('ZREM', tag .. ':d', k)
  local h = head(redis.call('HGET', tag .. ':r:' .. k, 'd'))
  if waiting(h) then queue(tag, k, h.prio) end
end
local want = tonumber(ARGV[4])
local out = {}
local taken = 0
for _, p in ipairs(redis.call('ZRANGE', tag .. ':qp', 0, -1)) do
  while taken < want do
    local ks = redis.call('ZRANGEBYLEX', tag .. ':q:' .. p, ARGV[2], ARGV[3], 'LIMIT', 0, want - taken)
    if #ks == 0 then break end
    for _, k in ipairs(ks) do
      local rk = tag .. ':r:' .. k
      local h = head(redis.call('HGET', rk, 'd'))
      unindex(tag, k)
      if waiting(h) then
        local a = h.attempts + 1
        local v = redis.call('INCR', KEYS[1])
        local value = 'dibs-claim 1\nstate processing\nattempts ' .. num(a) .. '\n'
        if p ~= '0' then value = value .. 'priority ' .. p .. '\n' end
        redis.call('HSET', rk, 'v', num(v), 'd', value .. ARGV[5], 't', num(now))
        redis.call('ZADD', tag .. ':p', 0, k)
        redis.call('PUBLISH', tag .. ':c:' .. k, 'w')
        out[#out + 1] = k
        out[#out + 1] = v
        out[#out + 1] = a
        out[#out + 1] = p
        taken = taken + 1
      end
    end
  end
  if taken >= want then break end
end
return out
)lua";
  static constexpr std::string_view read_aged_lua = R"lua(
local r = redis.call('HMGET', KEYS[1], 'v', 'd', 't')
if not r[1] then return false end
local t = redis.call('TIME')
local age = t[1] * 1000 + math.floor(t[2] / 1000) - tonumber(r[3])
if age < 0 then age = 0 end
return {r[1], r[2], age}
)lua";
  // KEYS: the key index; ARGV: the records' prefix, the range, how many.
  // Returns {scanned, last scanned, live keys...}.
  static constexpr std::string_view keys_lua = R"lua(
local page = redis.call('ZRANGEBYLEX', KEYS[1], ARGV[2], ARGV[3], 'LIMIT', 0, tonumber(ARGV[4]))
local out = {#page, page[#page] or ''}
for _, k in ipairs(page) do
  if redis.call('EXISTS', ARGV[1] .. k) == 1 then out[#out + 1] = k else redis.call('ZREM', KEYS[1], k) end
end
return out
)lua";
  static std::string script_text(script_id s) {
    switch (s) {
      case script_id::write: return std::string(queue_lua) + std::string(write_lua);
      case script_id::write_n: return std::string(queue_lua) + std::string(write_n_lua);
      case script_id::take: return std::string(queue_lua) + std::string(take_lua);
      case script_id::read_aged: return std::string(read_aged_lua);
      case script_id::keys: return std::string(keys_lua);
      case script_id::count: break;
    }
    return {};
  }

  // The waiters' connection: SUBSCRIBEd to the channels of the keys waited
  // for (at most 256; then it starts again).
  class listener_connection {
  public:
    bool wait(const redis_store& store, const std::string& chan, std::chrono::nanoseconds timeout) {
      std::lock_guard g{c_.m};
      const auto until = std::chrono::steady_clock::now() + timeout;
      try {
        if (!c_.open()) {
          channels_.clear();
          store.connect(c_, store.deadline(until));
        }
        if (!channels_.contains(chan)) {
          if (channels_.size() >= 256) {
            store.send(c_, {"UNSUBSCRIBE"}, until);
            channels_.clear();
          }
          store.send(c_, {"SUBSCRIBE", chan}, until);
          channels_.insert(chan);
          return true;  // a change before this could not be seen: read again
        }
        for (;;) {
          auto r = store.receive(c_, until, true);
          if (!r) return false;  // the time passed
          if (r->type == REDIS_REPLY_ARRAY && r->elements == 3 && r->element[0]->type == REDIS_REPLY_STRING &&
              std::string_view(r->element[0]->str, r->element[0]->len) == "message" &&
              r->element[1]->type == REDIS_REPLY_STRING &&
              std::string_view(r->element[1]->str, r->element[1]->len) == chan)
            return true;
          // Another key's change, or a (un)subscribe confirmation: wait on.
        }
      } catch (const std::system_error&) {
        c_.close();
        channels_.clear();
        return true;  // the connection was lost: changes may have been missed
      }
    }
    void close() noexcept { c_.close(); }

  private:
    connection c_;
    std::set<std::string> channels_;
  };

  // ----- keys and channels

  // The ZRANGEBYLEX range of the keys starting with `prefix`: from
  // "[prefix" to "(upper", upper being the first string above all of them
  // (none: "+").
  static std::pair<std::string, std::string> lex_range(std::string_view prefix) {
    std::string upper(prefix);
    while (!upper.empty() && static_cast<unsigned char>(upper.back()) == 0xff) upper.pop_back();
    if (!upper.empty()) upper.back() = static_cast<char>(static_cast<unsigned char>(upper.back()) + 1);
    return {prefix.empty() ? std::string("-") : "[" + std::string(prefix), upper.empty() ? std::string("+") : "(" + upper};
  }
  // The members of the sorted set `zset` (score 0) starting with `prefix`,
  // read in pages.
  std::vector<std::string> lex_list(const std::string& zset, std::string_view prefix, std::string_view what) {
    auto [min, max] = lex_range(prefix);
    std::vector<std::string> out;
    for (;;) {
      const auto r = run({"ZRANGEBYLEX", zset, min, max, "LIMIT", "0", "1000"}, time_limit::max(), false, what, {});
      if (r->type != REDIS_REPLY_ARRAY) bad_reply(what, {});
      for (std::size_t i = 0; i < r->elements; ++i) out.push_back(text(r->element[i]));
      if (r->elements < 1000) return out;
      min = "(" + out.back();
    }
  }

  std::string rec_key(std::string_view key) const {
    std::string k = tag_;
    k += ":r:";
    k += key;
    return k;
  }
  std::string seq_key() const { return tag_ + ":seq"; }
  std::string index_key() const { return tag_ + ":keys"; }
  std::string channel(std::string_view key) const {
    std::string c = tag_;
    c += ":c:";
    c += key;
    return c;
  }

  // ----- the URL

  static int hex_digit(char c) noexcept {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  static std::string percent_decoded(std::string_view s) {
    std::string out;
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (s[i] == '%' && i + 2 < s.size() && hex_digit(s[i + 1]) >= 0 && hex_digit(s[i + 2]) >= 0) {
        out += static_cast<char>(hex_digit(s[i + 1]) * 16 + hex_digit(s[i + 2]));
        i += 2;
      } else {
        out += s[i];
      }
    }
    return out;
  }
  void parse_url(std::string_view url) {
    const auto bad = [&](std::string_view why) {
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::redis_store: bad URL '{}': {} (redis://[[USER]:PASSWORD@]HOST[:PORT][/DB])",
                                          redacted(url), why));
    };
    if (url.starts_with("rediss://"))
      throw std::system_error(std::make_error_code(std::errc::not_supported),
                              "dibs::redis_store: rediss:// (TLS) is not supported: hiredis 0.14, the client library "
                              "of Debian 12, has no TLS; reach the server over a TLS tunnel (stunnel, spiped) or a "
                              "private network");
    if (!url.starts_with("redis://")) bad("it must start with redis://");
    std::string_view rest = url.substr(8);
    if (const auto at = rest.rfind('@'); at != std::string_view::npos) {
      const auto cred = rest.substr(0, at);
      rest = rest.substr(at + 1);
      const auto colon = cred.find(':');
      if (colon == std::string_view::npos) {
        password_ = percent_decoded(cred);  // redis://PASSWORD@host, as redis-cli takes it
      } else {
        user_ = percent_decoded(cred.substr(0, colon));
        password_ = percent_decoded(cred.substr(colon + 1));
      }
    }
    std::string_view hostport = rest;
    if (const auto slash = rest.find('/'); slash != std::string_view::npos) {
      hostport = rest.substr(0, slash);
      const auto db = rest.substr(slash + 1);
      if (!db.empty()) {
        int n = -1;
        const auto [p, ec] = std::from_chars(db.data(), db.data() + db.size(), n);
        if (ec != std::errc{} || p != db.data() + db.size() || n < 0) bad("the database must be a number");
        db_ = n;
      }
    }
    if (hostport.starts_with('[')) {  // [::1]:6379
      const auto close = hostport.find(']');
      if (close == std::string_view::npos) bad("an IPv6 address must end with ']'");
      host_ = std::string(hostport.substr(1, close - 1));
      hostport = hostport.substr(close + 1);
      if (!hostport.empty() && hostport.front() == ':') port_ = std::string(hostport.substr(1));
      else if (!hostport.empty()) bad("':' must follow the IPv6 address");
    } else if (const auto colon = hostport.rfind(':'); colon != std::string_view::npos) {
      host_ = std::string(hostport.substr(0, colon));
      port_ = std::string(hostport.substr(colon + 1));
    } else {
      host_ = std::string(hostport);
    }
    if (host_.empty()) bad("no host");
    int p = 0;
    const auto [ptr, ec] = std::from_chars(port_.data(), port_.data() + port_.size(), p);
    if (port_.empty() || ec != std::errc{} || ptr != port_.data() + port_.size() || p < 1 || p > 65535)
      bad("the port must be 1 to 65535");
    server_ = fmt::format("{}:{}/{}", host_, port_, db_);
  }
  // The URL without its password, for messages.
  static std::string redacted(std::string_view url) {
    const auto at = url.rfind('@');
    const auto scheme = url.find("://");
    if (at == std::string_view::npos || scheme == std::string_view::npos || at < scheme) return std::string(url);
    return std::string(url.substr(0, scheme + 3)) + "***" + std::string(url.substr(at));
  }

  // ----- connections

  // How long a command may take: until `t`, but at least min_reply and at
  // most the store's timeout. A command of dibs's never waits inside the
  // server for another client (a script runs whole, at once), so a timed
  // operation's `t` (try_lock's 20 ms) is not for contention here, only
  // for a server that stopped answering: a round trip on a loaded machine
  // may take longer than 20 ms, and giving up then would be a lie ("busy").
  static constexpr std::chrono::milliseconds min_reply{1000};
  time_limit deadline(time_limit t) const {
    const auto now = std::chrono::steady_clock::now();
    return std::min(now + opts_.timeout, std::max(t, now + min_reply));
  }

  // Opens `c` (closing what it had): connects, logs in, selects the
  // database, learns its CLIENT ID, and ends the connection whose reply was
  // lost, if any. Throws as the constructor says.
  void connect(connection& c, time_limit until) const {
    const auto lost = c.lost;
    c.close();
    auto tcp = detail::connect_tcp(host_, port_, until);
    if (!tcp.resolved)
      throw std::system_error(make_error_code(errc::timed_out),
                              fmt::format("dibs::redis_store: cannot find server {}: the name was not resolved within "
                                          "{} ms (redis_store_options::timeout)",
                                          server_, opts_.timeout.count()));
    if (tcp.resolve_error != 0)
      throw std::system_error(make_error_code(errc::connection_lost),
                              fmt::format("dibs::redis_store: cannot find server {}: {}", server_,
                                          detail::resolve_error_text(tcp.resolve_error)));
    if (tcp.socket == detail::no_socket) {
      if (tcp.timed_out)
        throw std::system_error(make_error_code(errc::timed_out),
                                fmt::format("dibs::redis_store: cannot connect to {} within {} ms: {}; is the Redis "
                                            "server running?",
                                            server_, opts_.timeout.count(), tcp.tried));
      throw std::system_error(tcp.error, fmt::format("dibs::redis_store: cannot connect to {} ({}); is the Redis "
                                                     "server running?",
                                                     server_, tcp.tried));
    }
    c.fd = tcp.socket;
    c.owner = detail::socket_owner();
    c.reader.reset(::redisReaderCreate());
    if (!c.reader) throw std::bad_alloc();
    // HELLO is not used: RESP2 is what hiredis 0.14 reads.
    if (!password_.empty()) {
      std::vector<std::string> auth{"AUTH"};
      if (!user_.empty()) auth.push_back(user_);
      auth.push_back(password_);
      send(c, auth, until);
      const auto r = receive(c, until, false);
      if (r->type == REDIS_REPLY_ERROR) {
        const std::string e(r->str, r->len);
        c.close();
        throw std::system_error(std::make_error_code(std::errc::permission_denied),
                                fmt::format("dibs::redis_store: the server {} refused the login{}: {}", server_,
                                            user_.empty() ? std::string() : " of user '" + user_ + "'", e));
      }
    }
    if (db_ != 0) expect_ok(c, {"SELECT", std::to_string(db_)}, until, "select the database");
    send(c, {"CLIENT", "INFO"}, until);
    const auto info = receive(c, until, false);
    if (info->type == REDIS_REPLY_ERROR) {
      const std::string e(info->str, info->len);
      c.close();
      if (e.starts_with("NOAUTH"))
        throw std::system_error(std::make_error_code(std::errc::permission_denied),
                                fmt::format("dibs::redis_store: the server {} wants a password (give it in the URL: "
                                            "redis://:PASSWORD@{}): {}",
                                            server_, host_, e));
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::redis_store: {} does not answer as Redis 7 does (CLIENT INFO: {})",
                                          server_, e));
    }
    // "id=7 addr=127.0.0.1:40112 laddr=... ": the server's names of this
    // connection.
    const std::string line = text(info.get());
    const auto field = [&](std::string_view name) -> std::string {
      const auto at = line.find(std::string(name) + "=");
      if (at == std::string::npos || (at != 0 && line[at - 1] != ' ')) return {};
      const auto start = at + name.size() + 1;
      return line.substr(start, line.find(' ', start) - start);
    };
    const std::string id = field("id"), addr = field("addr");
    if (info->type != REDIS_REPLY_STRING || id.empty() || addr.empty()) not_redis(c, "CLIENT INFO");
    if (!lost.id.empty()) {
      // Ends the connection whose write's reply never came: once it is
      // gone, that write either ran or never will, and a read-back tells.
      // By its id and its address both, so that a server restarted since
      // (ids start again) ends no other client.
      send(c, {"CLIENT", "KILL", "ID", lost.id, "ADDR", lost.addr}, until);
      (void)receive(c, until, false);  // an error: it was gone already
    }
    c.id = id;
    c.addr = addr;
    c.lost = {};
  }

  [[noreturn]] void not_redis(connection& c, std::string_view what) const {
    c.close();
    throw std::system_error(make_error_code(errc::corrupt_record),
                            fmt::format("dibs::redis_store: {} does not answer {} as a Redis server does: is it one?",
                                        server_, what));
  }

  void expect_ok(connection& c, std::initializer_list<std::string_view> args, time_limit until,
                 std::string_view what) const {
    send(c, args, until);
    const auto r = receive(c, until, false);
    if (r->type == REDIS_REPLY_ERROR) {
      const std::string e(r->str, r->len);
      c.close();
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::redis_store: cannot {} on {}: {}", what, server_, e));
    }
  }

  void check_fsync(connection& c) const {
    const auto until = deadline(time_limit::max());
    send(c, {"CONFIG", "GET", "append*"}, until);
    const auto r = receive(c, until, false);
    if (r->type != REDIS_REPLY_ARRAY)
      throw std::system_error(
          make_error_code(errc::invalid_argument),
          fmt::format("dibs::redis_store: require_fsync_always: cannot read the server's appendonly and appendfsync "
                      "(CONFIG GET: {}); allow CONFIG GET to this user, or set require_fsync_always = false",
                      server_, r->type == REDIS_REPLY_ERROR ? std::string(r->str, r->len) : "no list"));
    std::string appendonly, appendfsync;
    for (std::size_t i = 0; i + 1 < r->elements; i += 2) {
      const auto name = text(r->element[i]);
      if (name == "appendonly") appendonly = text(r->element[i + 1]);
      if (name == "appendfsync") appendfsync = text(r->element[i + 1]);
    }
    if (appendonly != "yes" || appendfsync != "always")
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::redis_store: the server {} has appendonly {} and appendfsync {}: "
                                          "require_fsync_always wants appendonly yes and appendfsync always (an "
                                          "acknowledged write can otherwise be lost with the server's machine)",
                                          server_, appendonly, appendfsync));
  }

  void send(connection& c, std::initializer_list<std::string_view> args, time_limit until,
            bool* sent = nullptr) const {
    send<std::initializer_list<std::string_view>>(c, args, until, sent);
  }

  // Sends one command. Throws errc::connection_lost (the connection closed:
  // nothing of it was sent, or it may have been: `sent` says) or timed_out.
  template <class Args>
  void send(connection& c, const Args& args, time_limit until, bool* sent = nullptr) const {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (const auto& a : args) {
      argv.push_back(std::data(a));
      lens.push_back(std::size(a));
    }
    char* cmd = nullptr;
    const int n = ::redisFormatCommandArgv(&cmd, static_cast<int>(argv.size()), argv.data(), lens.data());
    if (n < 0 || !cmd) throw std::bad_alloc();
    std::unique_ptr<char, void (*)(char*)> guard{cmd, ::redisFreeCommand};
    std::size_t done = 0;
    while (done < static_cast<std::size_t>(n)) {
      const auto w = detail::send_socket(c.fd, cmd + done, static_cast<std::size_t>(n) - done);
      if (w > 0) {
        done += static_cast<std::size_t>(w);
        if (sent) *sent = true;
        continue;
      }
      if (w < 0 && detail::socket_would_block()) {
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
        if (left.count() > 0 && detail::wait_socket(c.fd, true, left) >= 0) continue;
        c.close();
        throw std::system_error(make_error_code(errc::timed_out),
                                fmt::format("dibs::redis_store: the server {} took no request within the time", server_));
      }
      const std::string why = w < 0 ? detail::last_socket_error_text() : "closed";
      c.close();
      throw std::system_error(make_error_code(errc::connection_lost),
                              fmt::format("dibs::redis_store: the connection to {} broke: {}", server_, why));
    }
  }

  // Reads the next reply by `until`. Returns nothing if the time passed and
  // `may_time_out` (the connection stays usable); otherwise throws
  // errc::timed_out or errc::connection_lost, closing the connection.
  reply receive(connection& c, time_limit until, bool may_time_out) const {
    for (;;) {
      void* out = nullptr;
      if (::redisReaderGetReply(c.reader.get(), &out) != REDIS_OK) {
        c.close();
        throw std::system_error(make_error_code(errc::connection_lost),
                                fmt::format("dibs::redis_store: {} sent what is not the Redis protocol", server_));
      }
      if (out) return reply{static_cast<redisReply*>(out)};
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      const int ready = left.count() > 0 ? detail::wait_socket(c.fd, false, left) : 0;
      if (ready == 0) {
        if (may_time_out) return nullptr;
        c.close();
        throw std::system_error(make_error_code(errc::timed_out),
                                fmt::format("dibs::redis_store: no reply from {} in time", server_));
      }
      char buf[16384];
      const auto n = ready > 0 ? detail::recv_socket(c.fd, buf, sizeof buf) : -1;
      if (n < 0 && detail::socket_would_block()) continue;
      if (n <= 0) {
        const std::string why = n < 0 ? detail::last_socket_error_text() : "the server closed it";
        c.close();
        throw std::system_error(make_error_code(errc::connection_lost),
                                fmt::format("dibs::redis_store: the connection to {} broke: {}", server_, why));
      }
      if (::redisReaderFeed(c.reader.get(), buf, static_cast<std::size_t>(n)) != REDIS_OK) throw std::bad_alloc();
    }
  }

  // The calling thread's connection (see postgres_store::current()).
  connection& current() {
    if (detail::renewal_keeper::in_task()) return renewals_;
    thread_local std::vector<std::pair<std::uint64_t, std::size_t>> given;
    for (const auto& [id, i] : given)
      if (id == id_) return *sessions_[i];
    if (given.size() > 64) given.clear();
    const std::size_t i = next_session_.fetch_add(1, std::memory_order_relaxed) % sessions_.size();
    given.emplace_back(id_, i);
    return *sessions_[i];
  }
  static std::uint64_t next_id() {
    static std::atomic<std::uint64_t> n{0};
    return ++n;
  }

  // Runs one command on the calling thread's connection, by `t` (and the
  // store's timeout). A reply lost after a write was sent: outcome_unknown.
  // The server's refusals: see refusal().
  template <class Args>
  reply run_args(const Args& args, time_limit t, bool is_write, std::string_view what, std::string_view key) {
    connection& c = current();
    std::lock_guard g{c.m};
    const auto until = deadline(t);
    if (!c.open()) connect(c, until);
    bool sent = false;
    try {
      send(c, args, until, &sent);
      auto r = receive(c, until, false);
      if (is_write && opts_.replicas > 0 && r->type != REDIS_REPLY_ERROR) await_replicas(c);
      return r;
    } catch (const std::system_error& e) {
      if (is_write && sent) {
        c.lost = {c.id, c.addr};  // ended by the next connect, before the read-back
        throw std::system_error(make_error_code(errc::outcome_unknown),
                                fmt::format("dibs::redis_store: {} of key '{}' in {}: {}", what, show_key(key), where(),
                                            e.what()));
      }
      throw;
    } catch (const std::runtime_error& e) {  // await_replicas: too few replicas have the write
      throw std::system_error(make_error_code(errc::outcome_unknown),
                              fmt::format("dibs::redis_store: {} of key '{}' in {}: {}", what, show_key(key), where(),
                                          e.what()));
    }
  }
  // WAIT for opts_.replicas after a write on `c` (the server counts the
  // replicas that have every write of this connection so far). Throws:
  // errc::outcome_unknown if fewer had it within opts_.replica_timeout.
  // A WAIT that fails otherwise (the connection broke) is caught by
  // run_args as a lost reply: outcome_unknown as well.
  void await_replicas(connection& c) {
    const auto n = std::to_string(opts_.replicas), ms = std::to_string(opts_.replica_timeout.count());
    send(c, {"WAIT", n, ms}, std::chrono::steady_clock::now() + opts_.timeout);
    const auto r = receive(c, std::chrono::steady_clock::now() + opts_.replica_timeout + opts_.timeout, false);
    if (r->type == REDIS_REPLY_INTEGER && r->integer >= opts_.replicas) return;
    const std::string got = r->type == REDIS_REPLY_INTEGER ? std::to_string(r->integer) : text(r.get());
    throw std::runtime_error(fmt::format("the write reached {} of the {} replicas asked for (WAIT {} {}): it is on "
                                         "the primary, and a failover to a replica without it would lose it",
                                         got, opts_.replicas, opts_.replicas, ms));
  }

  reply run(std::initializer_list<std::string_view> args, time_limit t, bool is_write, std::string_view what,
            std::string_view key) {
    auto r = run_args(args, t, is_write, what, key);
    if (r->type == REDIS_REPLY_ERROR) refusal(r.get(), what, key);
    return r;
  }

  // EVALSHA of a script, loading it (SCRIPT LOAD) where the server does not
  // have it (NOSCRIPT: nothing ran).
  reply script(script_id s, const std::vector<std::string>& keys, const std::vector<std::string>& args, time_limit t,
               bool is_write, std::string_view what, std::string_view key) {
    const auto i = static_cast<std::size_t>(s);
    for (int attempt = 0;; ++attempt) {
      std::string sha;
      {
        std::lock_guard g{shas_m_};
        sha = shas_[i];
      }
      if (sha.empty()) {
        const std::string text_of_script = script_text(s);
        auto r = run_args(std::initializer_list<std::string_view>{"SCRIPT", "LOAD", text_of_script}, t, false,
                          "load dibs's scripts", {});
        if (r->type != REDIS_REPLY_STRING) refusal(r.get(), "load dibs's scripts", {});
        sha = text(r.get());
        std::lock_guard g{shas_m_};
        shas_[i] = sha;
      }
      std::vector<std::string_view> argv{"EVALSHA", sha};
      const std::string nkeys = std::to_string(keys.size());
      argv.push_back(nkeys);
      for (const auto& k : keys) argv.push_back(k);
      for (const auto& a : args) argv.push_back(a);
      auto r = run_args(argv, t, is_write, what, key);
      if (r->type == REDIS_REPLY_ERROR && std::string_view(r->str, r->len).starts_with("NOSCRIPT") && attempt < 2) {
        std::lock_guard g{shas_m_};
        shas_[i].clear();
        continue;
      }
      if (r->type == REDIS_REPLY_ERROR) refusal(r.get(), what, key);
      return r;
    }
  }

  reply write(std::string_view key, std::string_view mode, const std::string& expected, std::string_view value,
              time_limit t, std::string_view what) {
    return script(script_id::write, {rec_key(key), seq_key(), index_key()},
                  {std::string(mode), expected, std::string(value), std::string(key), channel(key), tag_}, t, true, what,
                  key);
  }

  // Throws what the server's error reply `r` means: the server loading its
  // data, busy with a script, or out of memory: transient; a read-only
  // replica, a refused login or anything else: not.
  [[noreturn]] void refusal(const redisReply* r, std::string_view what, std::string_view key) const {
    const std::string e(r->str, r->len);
    const std::string about = key.empty() ? std::string(what) : fmt::format("{} of key '{}'", what, show_key(key));
    if (e.starts_with("LOADING") || e.starts_with("BUSY") || e.starts_with("TRYAGAIN") || e.starts_with("MASTERDOWN") ||
        e.starts_with("CLUSTERDOWN"))
      throw std::system_error(make_error_code(errc::connection_lost),
                              fmt::format("dibs::redis_store: {} in {}: the server is not ready: {} (transient)", about,
                                          where(), e));
    if (e.starts_with("READONLY"))
      throw std::system_error(std::make_error_code(std::errc::read_only_file_system),
                              fmt::format("dibs::redis_store: {} in {}: the server is a read-only replica ({}); "
                                          "connect to the primary",
                                          about, where(), e));
    if (e.starts_with("NOAUTH") || e.starts_with("WRONGPASS") || e.starts_with("NOPERM"))
      throw std::system_error(std::make_error_code(std::errc::permission_denied),
                              fmt::format("dibs::redis_store: {} in {}: {}", about, where(), e));
    if (e.starts_with("MOVED") || e.starts_with("ASK"))
      throw std::system_error(std::make_error_code(std::errc::not_supported),
                              fmt::format("dibs::redis_store: {} in {}: the server is a Redis Cluster node that does "
                                          "not have the namespace's slot ({}); connect to the node that has it",
                                          about, where(), e));
    throw std::system_error(std::make_error_code(std::errc::io_error),
                            fmt::format("dibs::redis_store: {} in {}: the server refused: {}", about, where(), e));
  }

  [[noreturn]] void bad_reply(std::string_view what, std::string_view key) const {
    throw std::system_error(make_error_code(errc::corrupt_record),
                            fmt::format("dibs::redis_store: {} of key '{}' in {}: a reply of an unexpected shape (a "
                                        "record written by another program?)",
                                        what, show_key(key), where()));
  }

  static std::string text(const redisReply* r) {
    if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS) return std::string(r->str, r->len);
    if (r->type == REDIS_REPLY_INTEGER) return std::to_string(r->integer);
    return {};
  }
  std::uint64_t number(const redisReply* r, std::string_view what, std::string_view key) const {
    if (r->type == REDIS_REPLY_INTEGER && r->integer >= 0) return static_cast<std::uint64_t>(r->integer);
    std::uint64_t n = 0;
    if (r->type == REDIS_REPLY_STRING) {
      const auto [p, ec] = std::from_chars(r->str, r->str + r->len, n);
      if (ec == std::errc{} && p == r->str + r->len) return n;
    }
    bad_reply(what, key);
  }
  std::vector<std::optional<dibs::version>> per_item(const reply& r, std::size_t n, std::string_view what) const {
    if (r->type != REDIS_REPLY_ARRAY || r->elements != n) bad_reply(what, {});
    std::vector<std::optional<dibs::version>> out;
    out.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
      const auto v = number(r->element[i], what, {});
      out.push_back(v == 0 ? std::nullopt : std::optional<dibs::version>{v});
    }
    return out;
  }

  redis_store_options opts_;
  std::string host_, port_ = "6379", user_, password_, server_, tag_;
  int db_ = 0;
  std::vector<std::unique_ptr<connection>> sessions_;
  connection renewals_;
  const std::uint64_t id_ = next_id();
  std::atomic<std::size_t> next_session_{0};
  std::mutex shas_m_;
  std::string shas_[static_cast<std::size_t>(script_id::count)];
  // The waiters' connections are the waiters', not the store's state.
  mutable listener_connection listener_, offers_;
};

static_assert(listable_store<redis_store>);
static_assert(timed_shared_store<redis_store>);
static_assert(store_with_clock<redis_store>);
static_assert(store_with_wall_clock<redis_store>);
static_assert(create_or_read_store<redis_store>);
static_assert(batch_store<redis_store>);
static_assert(requires(const redis_store& s) { s.wait_for_change("k", std::chrono::seconds{1}); });
static_assert(requires(const redis_store& s) { s.wait_for_offer(std::chrono::seconds{1}); });

}  // namespace dibs
