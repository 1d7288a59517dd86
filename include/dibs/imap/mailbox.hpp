// dibs/imap/mailbox.hpp: workers watching one shared IMAP mailbox (INBOX,
// say) claim each message in it exactly once, and a person sees in any mail
// client which message is being handled, done or failed.
//
//   dibs::imap_store store{server};                 // the claims: folder "dibs"
//   dibs::imap_mailbox inbox{server, store};        // the messages: INBOX
//   while (auto mail = inbox.next(std::chrono::minutes{1})) {
//     handle(mail->raw());
//     mail->complete("order 17");
//   }
//
// The authority is the claim in the store (marker_claim<imap_store>), keyed
// by the message: "mail/<mailbox>/uid/<UIDVALIDITY>/<UID>" (each delivered
// copy is one item), or with key_by::message_id "mail/<mailbox>/id/<Message-ID>"
// (a message delivered twice, or moved away and back, is one item; a
// message without a Message-ID is then keyed by its UID, and on_note says
// so; a copy found expunged when claimed is never the item's end: another
// copy is handed out, or the claim is given back for the copy that comes
// back). The keywords on the message are a view, set after the store decided,
// never read to decide anything (they are sent without waiting for the
// server, which sets them while the worker writes to the store on the other
// connection; the mailbox's next command reads that it did):
//
//   $Processing   a worker holds the claim
//   $Completed    the claim was completed (complete())
//   $Failed       the claim failed (given back on its last attempt)
//
// A worker that dies leaves $Processing behind; its claim is recovered by
// the rules of marker_claim (its process is gone, or its lease ran out), the
// next worker takes the message, and the keywords follow. A view left
// wrong by a crash between the store's decision and the keyword is
// repaired when a watcher next scans the mailbox.
//
// next() waits for new mail with IDLE (RFC 2177), not by polling, and looks
// again at least every third of the claims' lease (at most 2 s) for claims of workers
// that are gone. Failures of the server (restarting, unreachable, and
// for 30 s after a reconnect an internal error, NO [SERVERBUG], which
// Dovecot answers while it repairs what a crash left) are waited out
// inside next() until its wait ends, and the store (imap_store) treats
// them as transient too: they cost no message an attempt; a refused login, a mailbox
// that does not exist or is read-only throw, naming server and mailbox.
// One thread uses an imap_mailbox (and the mail it hands out) at a time; it
// needs its own connection
// (given by `server`) beside the store's.
#pragma once


#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <dibs/imap/client.hpp>
#include <dibs/imap/store.hpp>
#include <dibs/marker_claim.hpp>

namespace dibs {

struct imap_mailbox_options {
  /// The shared mailbox the messages arrive in.
  std::string mailbox = "INBOX";
  /// What a claim is keyed by: the delivered copy (its UID) or the message
  /// (its Message-ID).
  enum class key_by { uid, message_id } key = key_by::uid;
  /// The keywords that show the state on the message. An empty
  /// processing_keyword: a message being handled shows no keyword (one
  /// keyword write, fsync'd on most servers, less per message).
  std::string processing_keyword = "$Processing";
  std::string completed_keyword = "$Completed";
  std::string failed_keyword = "$Failed";
  /// The claims' lease, attempts, renewal (marker_claim).
  claim_options claims{};
  /// Told about what costs nothing but a person may want to know (a
  /// message without Message-ID, a keyword that could not be set). Unset:
  /// one line on stderr.
  std::function<void(std::string_view)> on_note{};
};

class imap_mailbox {
public:
  using claims_type = marker_claim<imap_store>;

  /// A message this worker holds the claim on.
  class mail {
  public:
    mail(mail&&) noexcept = default;
    mail& operator=(mail&&) noexcept = default;

    std::uint32_t uid() const noexcept { return uid_; }
    const std::string& key() const noexcept { return claim_.key(); }
    const std::string& message_id() const noexcept { return message_id_; }
    /// The whole message as the server keeps it (RFC 5322 text).
    const std::string& raw() const noexcept { return raw_; }
    /// The claim's fencing token (see marker_claim::claim::token).
    dibs::version token() const noexcept { return claim_.token(); }
    std::uint32_t attempts() const noexcept { return claim_.attempts(); }
    /// Returns: true if the claim was lost (see marker_claim::claim::lost).
    bool lost() const noexcept { return claim_.lost(); }

    /// Effects: completes the claim (the authority), then sends the
    /// keywords that show $Completed on the message; the server sets them
    /// while the worker goes on (the mailbox's next command, or its
    /// destructor, reads that it did). Throws: as
    /// marker_claim::claim::complete; a keyword that cannot be set is only
    /// noted (the view is repaired later).
    void complete(std::string_view result = {}) {
      claim_.complete(result);
      box_->show_ahead(validity_, uid_, box_->opts_.completed_keyword);
      box_->done(uid_);
    }

    /// Effects: gives the message back with `error` (it is failed on its
    /// last attempt, and shows $Failed); it is handed out again after
    /// options.claims.retry_backoff (by default 0.5-1 s after the first
    /// attempt, doubling). Returns: false if the claim was taken over.
    bool release(std::string_view error) {
      const auto key_copy = claim_.key();
      const bool ok = claim_.release(error);
      const auto st = box_->claims_.status(key_copy);
      box_->show(validity_, uid_, st.state == claim_state::failed ? box_->opts_.failed_keyword : std::string{});
      if (st.state == claim_state::failed) box_->done(uid_);
      else box_->held_.erase(uid_);  // claimable again, also here
      return ok;
    }

  private:
    friend class imap_mailbox;
    mail(imap_mailbox* box, claims_type::claim c, std::uint32_t uid, std::string id, std::string raw)
        : box_(box), claim_(std::move(c)), validity_(box->validity_), uid_(uid), message_id_(std::move(id)),
          raw_(std::move(raw)) {}
    imap_mailbox* box_;
    claims_type::claim claim_;
    std::uint32_t validity_;  // of the mailbox when the message was claimed
    std::uint32_t uid_;
    std::string message_id_;
    std::string raw_;
  };

  /// One message of the mailbox and what the store says of it (status()).
  struct entry {
    std::uint32_t uid = 0;
    std::string key;
    std::vector<std::string> keywords;  ///< the flags shown on the message
    claim_status status;                ///< the authority
  };

  /// Connects (a connection of its own) and selects the mailbox.
  /// Requires: `store` outlives this object. Throws: a refused login, the
  /// mailbox missing or read-only, naming server and mailbox.
  imap_mailbox(imap::options server, imap_store& store, imap_mailbox_options o = {})
      : opts_(std::move(o)), session_(std::move(server)), store_(&store), claims_(store, opts_.claims) {
    select();
  }
  /// Reads whether the keywords last sent were set (before the connection closes).
  ~imap_mailbox() {
    try {
      drain();
    } catch (...) {
    }
  }
  imap_mailbox(const imap_mailbox&) = delete;
  imap_mailbox& operator=(const imap_mailbox&) = delete;

  /// Returns: "user@host:port mailbox 'INBOX'", for messages.
  std::string where() const { return fmt::format("{} mailbox '{}'", session_.where(), opts_.mailbox); }
  claims_type& claims() noexcept { return claims_; }

  /// Returns: a claim on a message nobody has handled (or whose worker is
  /// gone), waiting for one with IDLE up to `wait`; nothing if none came.
  std::optional<mail> next(std::chrono::milliseconds wait) {
    const auto end = std::chrono::steady_clock::now() + wait;
    const auto wake = recheck();
    for (;;) {
      try {
        if (auto m = scan_and_claim()) return m;
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
        if (left.count() <= 0) return std::nullopt;
        if (!held_.empty() || pending_.empty()) {
          drain();
          session_.idle(std::min(left, wake));
        }
      } catch (const std::system_error& e) {
        if (!is_transient(e.code()) && e.code() != make_error_code(errc::outcome_unknown)) throw;
        selected_ = false;
        if (!session_.connected()) recovery_.lost();
        if (std::chrono::steady_clock::now() >= end) return std::nullopt;
        std::this_thread::sleep_for(std::chrono::milliseconds{200});
      }
    }
  }

  /// Returns: every message of the mailbox with its keywords and what the
  /// store says of it, in UID order (for a listing, or a check that the
  /// view agrees with the store).
  std::vector<entry> status() {
    ready();
    const auto lines = fetch_all(1, fmt::format("listing {}", where()));
    auto states = states_now();
    std::vector<entry> out;
    for (auto& [uid, m] : parse(lines)) {
      entry e{uid, m.key, m.flags, {}};
      if (const auto it = states.find(m.key); it != states.end()) e.status = it->second;
      out.push_back(std::move(e));
    }
    return out;
  }

private:
  struct seen {
    std::string key;
    std::string message_id;
    std::vector<std::string> flags;
  };
  static constexpr std::string_view fetch_items = "(UID FLAGS BODY.PEEK[HEADER.FIELDS (MESSAGE-ID)])";

  void note(std::string_view what) {
    if (opts_.on_note) opts_.on_note(what);
    else std::fprintf(stderr, "dibs::imap_mailbox: %.*s\n", static_cast<int>(what.size()), what.data());
  }

  void select() {
    const auto r = session_.run(fmt::format("SELECT {}", imap::quote(opts_.mailbox)));
    // Dovecot 2.3 says "NO Mailbox doesn't exist: X", without [NONEXISTENT].
    if (!r.ok() && r.status == "NO" &&
        (session_code(r) == std::make_error_code(std::errc::no_such_file_or_directory) ||
         r.text.find("exist") != std::string::npos))
      throw std::system_error(std::make_error_code(std::errc::no_such_file_or_directory),
                              fmt::format("dibs::imap_mailbox: {} does not exist (the server said: {}); create it or "
                                          "name the mailbox the mail arrives in",
                                          where(), r.text));
    recovery_.check(session_, r, fmt::format("selecting {}", where()));
    if (imap::detail::istarts_with(r.code, "READ-ONLY"))
      throw std::system_error(std::make_error_code(std::errc::permission_denied),
                              fmt::format("dibs::imap_mailbox: {} is read-only for this user; dibs shows the state "
                                          "of each message with keywords there, so it needs the right to set them",
                                          where()));
    std::uint32_t validity = 0;
    for (const auto& u : r.untagged)
      if (const auto at = u.find("[UIDVALIDITY "); at != std::string::npos)
        validity = static_cast<std::uint32_t>(std::stoul(u.substr(at + 13)));
    read_.reset();
    if (validity != validity_) {  // a new mailbox (or the first look): every UID is new
      known_.clear();
      pending_.clear();
      held_.clear();
      unshown_.clear();
      last_uid_ = 0;
      validity_ = validity;
    }
    selected_ = true;
    recovery_.reconnected();
  }

  static std::error_code session_code(const imap::reply& r) {
    if (imap::detail::iequals(r.code, "NONEXISTENT") || imap::detail::iequals(r.code, "TRYCREATE"))
      return std::make_error_code(std::errc::no_such_file_or_directory);
    return {};
  }

  void ready() {
    drain();
    if (!session_.connected() || !selected_) select();
  }

  // Commands sent ahead (send_ahead), their replies not read yet: the
  // keywords of a show (its message, keyword and how many commands), or
  // the read of a message about to be claimed (`read`).
  struct sent_show {
    std::uint32_t uid;
    std::string keyword;
    std::size_t commands;
    bool read = false;
  };

  // Sends the read of message `uid` ahead of its claim: the server reads it
  // while the claim is written on the other connection, and take() uses it
  // if the claim is won. Reading is harmless if it is lost (BODY.PEEK sets
  // no \Seen), and a message's content never changes. Best effort: take()
  // reads it itself otherwise.
  void read_ahead(std::uint32_t uid) {
    if (!session_.connected() || !selected_) return;
    try {
      session_.send_ahead({fmt::format("UID FETCH {} (UID BODY.PEEK[])", uid)});
      sent_.push_back({uid, {}, 1, true});
    } catch (const std::system_error&) {
      selected_ = false;
    }
  }

  // Sends the commands that show `keyword` on message `uid` without
  // waiting for the server to do it (it fsyncs each STORE; meanwhile the
  // worker writes to the store on the other connection). Requires: the
  // decision the keyword shows is made.
  void send_show(std::uint32_t uid, const std::string& keyword, std::vector<std::string> commands) {
    unshown_.erase(uid);  // a keyword owed from before is out of date now
    session_.send_ahead(commands);
    sent_.push_back({uid, keyword, commands.size()});
  }

  // Reads whether the keywords sent ahead were set. One that was not (the
  // server refused it, the connection failed before it said) is noted and,
  // unless it was $Processing (shown again by nobody: the claim may be
  // over by the next look), tried again with the next look at the mailbox.
  void drain() {
    if (sent_.empty()) return;
    const auto shows = std::exchange(sent_, {});
    const auto replies = session_.finish();
    std::size_t at = 0;
    for (const auto& s : shows) {
      if (s.read) {
        // Its FETCH may come while an earlier command is still open (the
        // server runs them side by side): take() finds it by its UID.
        if (at < replies.size() && replies[at].ok()) read_ = {s.uid, imap::untagged_of(replies)};
        ++at;
        continue;
      }
      std::string why;
      for (std::size_t i = at; i < at + s.commands && why.empty(); ++i)
        if (i >= replies.size()) why = "the connection failed before the server said";
        else if (!replies[i].ok()) why = fmt::format("{} {}", replies[i].status, replies[i].text);
      at += s.commands;
      if (why.empty()) continue;
      selected_ = false;
      if (s.keyword != opts_.processing_keyword) unshown_[s.uid] = s.keyword;
      note(fmt::format("could not show '{}' on message UID {} in {} ({}); it is shown when a watcher next scans the "
                       "mailbox",
                       s.keyword, s.uid, where(), why));
    }
  }

  std::string key_of(std::uint32_t uid, const std::string& message_id) {
    const auto uid_key = fmt::format("mail/{}/uid/{}/{}", opts_.mailbox, validity_, uid);
    if (opts_.key == imap_mailbox_options::key_by::uid) return uid_key;
    if (message_id.empty()) {
      note(fmt::format("message UID {} in {} has no Message-ID: it is keyed by its UID ({})", uid, where(), uid_key));
      return uid_key;
    }
    auto key = fmt::format("mail/{}/id/{}", opts_.mailbox, message_id);
    if (key.size() <= key_rules::max_key_size) return key;
    // A Message-ID too long for a key (RFC 5322 sets no limit) is keyed by
    // a 128-bit digest of it, the same for every watcher.
    std::uint64_t h1 = 0xcbf29ce484222325ull, h2 = 0x84222325cbf29ce4ull;
    for (const char c : message_id) {
      h1 = (h1 ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
      h2 = (h2 ^ static_cast<unsigned char>(c)) * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
    }
    return fmt::format("mail/{}/id-digest/{:016x}{:016x}", opts_.mailbox, h1, h2);
  }

  std::map<std::uint32_t, seen> parse(const std::vector<std::string>& untagged) {
    std::map<std::uint32_t, seen> out;
    for (const auto& line : untagged) {
      const auto v = imap::parse(line);
      if (v.size() < 3 || !v[1].is("FETCH") || v[2].kind != imap::value::kind::list) continue;
      std::uint32_t uid = 0;
      seen s;
      std::string header;
      const auto& items = v[2].items;
      for (std::size_t i = 0; i + 1 < items.size(); i += 2) {
        if (items[i].is("UID")) uid = static_cast<std::uint32_t>(items[i + 1].number().value_or(0));
        else if (items[i].is("FLAGS"))
          for (const auto& f : items[i + 1].items) s.flags.push_back(f.text);
        else if (imap::detail::istarts_with(items[i].text, "BODY[HEADER")) header = items[i + 1].text;
      }
      if (uid == 0) continue;
      // "Message-ID: <a@b>\r\n\r\n", possibly folded
      if (const auto colon = header.find(':'); colon != std::string::npos) {
        for (const char c : header.substr(colon + 1))
          if (c != ' ' && c != '\t' && c != '\r' && c != '\n') s.message_id += c;
      }
      s.key = key_of(uid, s.message_id);
      out.emplace(uid, std::move(s));
    }
    return out;
  }

  std::map<std::string, claim_status> states_now() {
    std::map<std::string, claim_status> states;
    for (auto& item : claims_.list(fmt::format("mail/{}/", opts_.mailbox))) states[item.key] = item.status;
    return states;
  }

  bool has_flag(const seen& s, std::string_view flag) const {
    return std::any_of(s.flags.begin(), s.flags.end(), [&](const std::string& f) { return imap::detail::iequals(f, flag); });
  }

  // Learns the messages that arrived since the last look; on the first
  // look, what the store says of every message.
  // The untagged lines of "UID FETCH <from>:*", read again while the reply
  // says new mail came meanwhile (a FETCH reads the session's view as of
  // the previous command; see imap_store's sync()).
  // `also`: commands sent with the first round (their untagged lines are
  // returned with the rest; their failure is not checked).
  std::vector<std::string> fetch_all(std::uint32_t from, const std::string& what, std::vector<std::string> also = {}) {
    std::vector<std::string> lines;
    for (int round = 0;; ++round) {
      also.insert(also.begin(), {"NOOP", fmt::format("UID FETCH {}:* {}", from, fetch_items)});
      const auto r = session_.run(also);
      also.clear();
      recovery_.check(session_, r[1], what);
      bool grew = false;
      for (auto& line : imap::untagged_of(r)) {
        grew = grew || line.ends_with(" EXISTS");
        lines.push_back(std::move(line));
      }
      if (!grew || round == 20) return lines;
    }
  }

  // Also forgets the messages it holds pending that were expunged since
  // (moved to another folder, deleted): a message moved away and back is
  // a new UID, and its old UID must not stand for it (claimed through the
  // old UID, it would be found gone and the copy that came back never
  // handed out). The SEARCH runs on a view that has every UID seen before
  // (a view only loses messages by expunges), so a pending UID missing
  // from it is gone for good.
  void refresh() {
    ready();
    const bool first = last_uid_ == 0;
    const auto seen_before = last_uid_;
    std::vector<std::string> also;
    if (!pending_.empty()) also.push_back(fmt::format("UID SEARCH UID {}:{}", *pending_.begin(), seen_before));
    const auto lines = fetch_all(last_uid_ + 1, fmt::format("looking for new mail in {}", where()), also);
    looked_ = std::chrono::steady_clock::now();
    if (!also.empty()) {
      std::set<std::uint32_t> present;
      bool searched = false;
      for (const auto& line : lines) {
        const auto v = imap::parse(line);
        if (v.empty() || !v[0].is("SEARCH")) continue;
        searched = true;
        for (std::size_t i = 1; i < v.size(); ++i)
          if (const auto n = v[i].number()) present.insert(static_cast<std::uint32_t>(*n));
      }
      // "* SEARCH" with no UIDs is still a reply; none at all: it failed, and nothing is forgotten.
      if (searched)
        for (const auto uid : std::vector<std::uint32_t>(pending_.begin(), pending_.end()))
          if (uid <= seen_before && !present.count(uid)) {
            done(uid);
            unshown_.erase(uid);
          }
    }
    auto fresh = parse(lines);
    std::erase_if(fresh, [&](const auto& e) { return e.first <= last_uid_; });
    if (fresh.empty()) return;
    std::map<std::string, claim_status> states;
    if (first) states = states_now();
    for (auto& [uid, s] : fresh) {
      last_uid_ = std::max(last_uid_, uid);
      const auto it = states.find(s.key);
      const auto state = it == states.end() ? claim_state::absent : it->second.state;
      if (state == claim_state::completed || state == claim_state::failed) {
        settle(uid, s, state);
        continue;
      }
      known_.emplace(uid, std::move(s));
      pending_.insert(uid);
    }
  }

  // How soon a message another worker holds is looked at again: its worker
  // may die (on this host that is seen at once), or give it back.
  std::chrono::milliseconds recheck() const {
    return std::clamp(opts_.claims.lease / 3, std::chrono::milliseconds{200}, std::chrono::milliseconds{2000});
  }

  // Forgets a message that is completed or failed.
  void done(std::uint32_t uid) {
    pending_.erase(uid);
    held_.erase(uid);
    known_.erase(uid);
  }

  // The item is done: its keywords are made to agree with the store.
  void settle(std::uint32_t uid, const seen& s, claim_state state) {
    const auto& want = state == claim_state::completed ? opts_.completed_keyword : opts_.failed_keyword;
    if (!has_flag(s, want) || has_flag(s, opts_.processing_keyword)) {
      // Mostly the keywords its worker has set already (this copy of the
      // flags is from when the message arrived): sent without waiting.
      if (session_.connected() && selected_) {
        try {
          send_show(uid, want, keyword_commands(uid, want));
        } catch (const std::system_error&) {
          selected_ = false;
          unshown_[uid] = want;
        }
      } else {
        show(uid, want);
      }
    }
    done(uid);
  }

  // Shows `keyword` on the message (and removes the other two); empty:
  // none of them.
  std::vector<std::string> keyword_commands(std::uint32_t uid, const std::string& keyword, bool clear = true) const {
    std::string others;
    for (const auto* k : {&opts_.processing_keyword, &opts_.completed_keyword, &opts_.failed_keyword})
      if (*k != keyword && !k->empty()) others += (others.empty() ? "" : " ") + *k;
    std::vector<std::string> commands;
    if (clear && !others.empty()) commands.push_back(fmt::format("UID STORE {} -FLAGS.SILENT ({})", uid, others));
    if (!keyword.empty()) commands.push_back(fmt::format("UID STORE {} +FLAGS.SILENT ({})", uid, keyword));
    return commands;
  }

  // As show(validity, uid, keyword), without waiting for the server.
  void show_ahead(std::uint32_t validity, std::uint32_t uid, const std::string& keyword) {
    try {
      ready();
      if (validity == validity_) send_show(uid, keyword, keyword_commands(uid, keyword));
    } catch (const std::system_error& e) {
      selected_ = false;
      unshown_[uid] = keyword;
      note(fmt::format("could not show '{}' on message UID {} in {} ({}); it is tried again with the next look at "
                       "the mailbox",
                       keyword, uid, where(), e.what()));
    }
  }

  // As show(), for a message of the mailbox as it was (UIDVALIDITY
  // `validity`): nothing if the mailbox was re-created since (its UIDs
  // name other messages now).
  void show(std::uint32_t validity, std::uint32_t uid, const std::string& keyword) {
    try {
      ready();
    } catch (const std::system_error&) {
    }
    if (validity == validity_) show(uid, keyword);
  }

  void show(std::uint32_t uid, const std::string& keyword) {
    unshown_.erase(uid);
    const auto commands = keyword_commands(uid, keyword);
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        ready();
        for (const auto& r : session_.run(commands)) session_.check(r, fmt::format("showing {} on UID {}", keyword, uid));
        return;
      } catch (const std::system_error& e) {
        selected_ = false;
        if (attempt == 1) {
          unshown_[uid] = keyword;
          note(fmt::format("could not show '{}' on message UID {} in {} ({}); it is tried again with the next look "
                           "at the mailbox",
                           keyword, uid, where(), e.what()));
        }
      }
    }
  }

  // A message known to be waiting is claimed before the mailbox is looked
  // at again: that look would wait for the keywords just sent (the server
  // answers in order), and the claim's write in the store runs meanwhile.
  // Only while the last look is recent (`recheck`): a message moved away
  // since is found gone when claimed (its claim then ends as described at
  // the top), which costs more than the look.
  std::optional<mail> scan_and_claim() {
    show_owed();
    if (!pending_.empty() && std::chrono::steady_clock::now() - looked_ < recheck())
      if (auto m = claim_known()) return m;
    refresh();
    show_owed();
    return claim_known();
  }

  void show_owed() {
    for (auto owed = std::exchange(unshown_, {}); const auto& [uid, keyword] : owed) show(uid, keyword);
  }

  std::optional<mail> claim_known() {
    std::vector<std::uint32_t> order(pending_.begin(), pending_.end());
    std::shuffle(order.begin(), order.end(), rng_);  // workers spread over the backlog
    const auto now = std::chrono::steady_clock::now();
    for (const auto uid : order) {
      const auto held = held_.find(uid);
      if (held != held_.end() && held->second > now) continue;  // someone else's, looked at lately
      if (!known_.count(uid)) continue;  // forgotten meanwhile (expunged, or settled)
      const auto s = known_.at(uid);
      // What the store said at its last look (this worker's last claim or
      // completion) spares a claim attempt, two reads, for a message
      // another worker completed or holds; only a final state is taken as
      // it is (it never changes back), and a held one is tried as before
      // once `recheck` has passed.
      if (const auto cached = store_->read_cached(s.key)) {
        const auto state = detail::field(cached->value, "state");
        if (state == "completed" || state == "failed") {
          settle(uid, s, state == "completed" ? claim_state::completed : claim_state::failed);
          continue;
        }
        if (state == "processing" && held == held_.end()) {
          held_[uid] = now + recheck();
          continue;
        }
      }
      std::optional<claims_type::claim> c;
      read_ahead(uid);
      try {
        c = claims_.try_claim(s.key);
      } catch (const std::system_error& e) {
        if (is_transient(e.code()) || e.code() == make_error_code(errc::outcome_unknown)) throw;
        // This message's trouble (its key refused, say) costs only it: said, and tried again later.
        note(fmt::format("message UID {} in {} cannot be claimed: {}", uid, where(), e.what()));
        held_[uid] = now + recheck();
        continue;
      }
      if (!c) {
        const auto st = claims_.status(s.key);
        if (st.state == claim_state::completed || st.state == claim_state::failed) settle(uid, s, st.state);
        else held_[uid] = now + recheck();
        continue;
      }
      // Still pending here until it is completed or failed: a claim given
      // back (or dropped) is looked at again after `recheck`.
      held_[uid] = now + recheck();
      if (auto raw = take(uid, s, *c)) return mail{this, std::move(*c), uid, s.message_id, std::move(*raw)};
      done(uid);
      if (opts_.key == imap_mailbox_options::key_by::uid || s.message_id.empty()) {
        // This copy was the item, and it is gone for good (a UID is never
        // used again): nothing to handle, and nothing hidden.
        note(fmt::format("message UID {} in {} was expunged before it was handled", uid, where()));
        c->complete("expunged before it was handled");
        continue;
      }
      // The item is the Message-ID: another copy of it may be here (a
      // second delivery, or the message moved away and back under a new
      // UID), and the claim holds for that copy.
      refresh();
      std::optional<std::string> raw;
      std::uint32_t copy = 0;
      for (const auto& [u, other] : std::map<std::uint32_t, seen>(known_))
        if (u != uid && other.key == s.key) {
          held_[u] = now + recheck();
          if ((raw = take(u, other, *c))) {
            copy = u;
            break;
          }
          done(u);
        }
      if (raw) return mail{this, std::move(*c), copy, s.message_id, std::move(*raw)};
      // No copy is here now (moved away, maybe to come back): given back,
      // never completed, so that a copy that comes back is handed out.
      note(fmt::format("message UID {} ({}) in {} was expunged before it was handled, and no other copy of it is "
                       "there: it is handed out when one comes back",
                       uid, s.message_id, where()));
      c->release("expunged before it was handled; no other copy was in the mailbox");
    }
    return std::nullopt;
  }

  // Reads message `uid` (claimed by `c`) and sends the keywords that show
  // $Processing on it, which the server sets while the message is handled.
  // Returns: the whole message, or nothing if it was expunged.
  std::optional<std::string> take(std::uint32_t uid, const seen& s, const claims_type::claim& c) {
    // The other keywords are taken off only where they can be (a message
    // claimed before, or one a person marked).
    const bool marked = std::any_of(s.flags.begin(), s.flags.end(), [&](const std::string& f) {
      return imap::detail::iequals(f, opts_.processing_keyword) || imap::detail::iequals(f, opts_.completed_keyword) ||
             imap::detail::iequals(f, opts_.failed_keyword);
    });
    ready();
    std::vector<std::string> lines;
    if (read_ && read_->first == uid) {
      lines = std::move(read_->second);
    } else {
      auto r = session_.run(fmt::format("UID FETCH {} (UID BODY.PEEK[])", uid));
      recovery_.check(session_, r, fmt::format("reading message UID {} in {}", uid, where()));  // gives it back
      lines = std::move(r.untagged);
    }
    read_.reset();
    for (const auto& line : lines) {
      const auto v = imap::parse(line);
      if (v.size() < 3 || !v[1].is("FETCH") || v[2].kind != imap::value::kind::list) continue;
      const auto& items = v[2].items;
      std::optional<std::uint32_t> which;
      std::optional<std::string> body;
      for (std::size_t i = 0; i + 1 < items.size(); i += 2) {
        if (items[i].is("UID")) which = static_cast<std::uint32_t>(items[i + 1].number().value_or(0));
        else if (imap::detail::istarts_with(items[i].text, "BODY[")) body = items[i + 1].text;
      }
      // Dovecot answers an empty body for a message expunged by another
      // session before this one was told: gone, as if not found.
      if (body && !body->empty() && which.value_or(uid) == uid) {
        try {
          const auto commands = keyword_commands(uid, opts_.processing_keyword, c.attempts() > 1 || marked);
          if (!commands.empty()) send_show(uid, opts_.processing_keyword, commands);
        } catch (const std::system_error& e) {
          selected_ = false;
          note(fmt::format("could not show '{}' on message UID {} in {} ({}); it is shown when a watcher next "
                           "scans the mailbox",
                           opts_.processing_keyword, uid, where(), e.what()));
        }
        return body;
      }
    }
    return std::nullopt;
  }

  imap_mailbox_options opts_;
  imap::session session_;
  imap_store* store_;
  claims_type claims_;
  bool selected_ = false;
  std::uint32_t validity_ = 0;
  std::uint32_t last_uid_ = 0;
  std::chrono::steady_clock::time_point looked_{};  // the last look for new mail
  std::map<std::uint32_t, seen> known_;
  std::set<std::uint32_t> pending_;
  std::map<std::uint32_t, std::chrono::steady_clock::time_point> held_;
  std::map<std::uint32_t, std::string> unshown_;  // keywords a failure kept from being shown
  std::vector<sent_show> sent_;                   // commands sent ahead, their replies not read yet
  std::optional<std::pair<std::uint32_t, std::vector<std::string>>> read_;  // a message read ahead of its claim
  imap::detail::server_recovery recovery_;       // a server's internal error right after a reconnect: transient
  std::mt19937_64 rng_{std::random_device{}()};
};

}  // namespace dibs
