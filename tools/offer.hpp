// dibs offer: puts the keys of standard input in a claim store's queue
// (marker_claim::offer_n), for `dibs work` and `dibs claim --next`. Part of
// tools/dibs.cpp, included inside its namespace after with_store.
#pragma once

struct offer_args {
  std::string store;
  std::int32_t priority = 0;
  std::string not_before;  // a duration from now (10m), or @SECONDS since the epoch
  bool quiet = false;
  bool verbose = false;
};

// Keys per offer_n: one statement or transaction each.
constexpr std::size_t offer_batch = 1000;

// Returns: the time `s` names: a duration from now (parse_duration's
// forms), or @SECONDS since the epoch (fractions allowed).
std::chrono::system_clock::time_point parse_when(const std::string& what, const std::string& s) {
  if (!s.empty() && s[0] == '@') {
    std::size_t end = 0;
    double secs = -1;
    try {
      secs = std::stod(s.substr(1), &end);
    } catch (...) {
      end = 0;
    }
    if (end == 0 || end + 1 != s.size() || !(secs >= 0) || secs > 1e11)
      fail(ex::usage, fmt::format("{}: '{}' is not a time; write @SECONDS since the epoch (e.g. @{}, as 'date +%s' "
                                  "prints) or a duration from now (10m, 2h, 30s)",
                                  what, s, std::chrono::duration_cast<std::chrono::seconds>(
                                               std::chrono::system_clock::now().time_since_epoch()).count()));
    return std::chrono::system_clock::time_point{milliseconds{static_cast<milliseconds::rep>(secs * 1000.0 + 0.5)}};
  }
  return std::chrono::system_clock::now() + parse_duration(what, s);
}

// Reads the keys of standard input, one a line (a trailing "\r" dropped),
// and checks them all. Throws: failure(65) naming the line of an empty key,
// a key too long, or a key given twice (with both lines).
std::vector<std::string> read_keys(std::istream& in) {
  std::vector<std::string> keys;
  std::unordered_map<std::string, std::size_t> line_of;
  std::string line;
  for (std::size_t n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty())
      fail(ex::dataerr, fmt::format("dibs offer: line {} of standard input is empty: give one key a line, no blank "
                                    "lines; nothing was offered",
                                    n));
    if (line.size() > dibs::key_rules::max_key_size)
      fail(ex::dataerr, fmt::format("dibs offer: line {} of standard input is a key of {} bytes ('{}'); a key is at "
                                    "most {} bytes: key the item by a digest of its name (e.g. its SHA-256 in hex); "
                                    "nothing was offered",
                                    n, line.size(), dibs::show_key(line), dibs::key_rules::max_key_size));
    const auto [at, fresh] = line_of.emplace(line, n);
    if (!fresh)
      fail(ex::dataerr, fmt::format("dibs offer: line {} of standard input repeats the key '{}' of line {}: give each "
                                    "key once (e.g. through 'sort -u'); nothing was offered",
                                    n, dibs::show_key(line), at->second));
    keys.push_back(std::move(line));
  }
  if (in.bad()) fail(ex::ioerr, "dibs offer: cannot read standard input; nothing was offered");
  return keys;
}

int cmd_offer(offer_args& a) {
  dibs::offer_options o;
  o.priority = a.priority;
  if (!a.not_before.empty()) o.not_before = parse_when("dibs offer --not-before", a.not_before);
  return with_store(a.store, [&](auto& store) -> int {
    // Every line is read and checked before anything is written: bad input
    // writes nothing. (Read once the store is open: for a postgres: store,
    // with_store runs dibs-postgres, which must find standard input unread.)
    const std::vector<std::string> keys = read_keys(std::cin);
    if (keys.empty()) {
      if (a.verbose) fmt::print("0 offered: no keys on standard input\n");
      return ex::ok;
    }
    using S = std::remove_reference_t<decltype(store)>;
    dibs::marker_claim<S> claims{store};
    std::size_t fresh = 0, done = 0;
    try {
      for (; done < keys.size(); done += std::min(offer_batch, keys.size() - done)) {
        const std::span<const std::string> batch{keys.data() + done, std::min(offer_batch, keys.size() - done)};
        fresh += claims.offer_n(batch, o);
        if (a.verbose)
          std::cerr << redact(fmt::format("dibs offer: {} of {} keys offered to {} ({} new)\n",
                                          done + batch.size(), keys.size(), a.store, fresh));
      }
    } catch (const std::system_error&) {
      // Batches before this one are in the store: say how far it got (an
      // offer again is safe: a key that has a record is left as it is).
      std::cerr << redact(fmt::format("dibs offer: {} of {} keys were offered ({} new) before the error below; "
                                      "offering them all again is safe (a key that has a record is left as it is)\n",
                                      done, keys.size(), fresh));
      throw;
    }
    if (!a.quiet) fmt::print("{} offered, {} already had a record\n", fresh, keys.size() - fresh);
    return ex::ok;
  });
}
