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
// Where the claims are: an imap_mailbox keeps them in an IMAP folder
// (imap_store, on a server with UIDPLUS and QRESYNC); basic_imap_mailbox<S>
// keeps them in any listable store S: a server without QRESYNC (Exchange
// Online, Gmail) is watched with the claims in PostgreSQL (workers on many
// machines) or SQLite (one machine), the mailbox's view the same:
//
//   dibs::postgres_store claims{"host=db.internal dbname=mail", {.table = "orders_claims"}};
//   dibs::basic_imap_mailbox<dibs::postgres_store> inbox{exchange, claims};
//
// The authority is the claim in the store (marker_claim<Store>), keyed
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
// again at least every third of the claims' lease (at most 2 s) for
// claims of workers that are gone. Failures of the server (restarting,
// unreachable, and for 30 s after a reconnect an internal error, NO
// [SERVERBUG], which Dovecot answers while it repairs what a crash left)
// are waited out inside next() until its wait ends (backing off: 200 ms
// doubling to 5 s, with jitter, since each try may log in again), and so
// are the claims store's transient errors (imap_store treats the same
// failures of its server as transient; PostgreSQL's and SQLite's stores
// a lost connection or a busy database): they cost no message an
// attempt; a refused login, a mailbox that does not exist or is
// read-only throw, naming server and mailbox. One thread uses an
// imap_mailbox (and the mail it hands out) at a time; it needs its own
// connection (given by `server`) beside the store's.
//
// The folder view (view_by::folders; view_by::automatic, the default,
// chooses it where the mailbox keeps no keywords of the client's: no \* in
// the PERMANENTFLAGS of its SELECT, as on Exchange Online, whose Outlook
// would not show keywords anyway; on_note says so once). The state is
// shown by where the message is, in folders every client shows (by
// default subfolders of the mailbox, joined with the server's hierarchy
// delimiter: "INBOX/Processing"; created if absent):
//
//   the mailbox   nobody has claimed it yet
//   Processing    a worker holds the claim, or held it and gave it back
//                 (it is handed out again from there)
//   Done          the claim was completed (complete())
//   Failed        the claim failed (given back on its last attempt)
//
// A claim won is followed by a move (UID MOVE, RFC 6851; where the server
// lacks MOVE, UID COPY, UID STORE +FLAGS.SILENT (\Deleted) and UID EXPUNGE
// of that one message, RFC 4315; a server with neither MOVE nor UIDPLUS is
// refused, since a plain EXPUNGE would also remove every message a person
// marked \Deleted) to Processing, and complete() by a move to Done. next()
// looks for work in the mailbox and in Processing (a message whose worker
// died is there; its claim is recovered by the rules of marker_claim). A
// move changes a message's UID, so claims are keyed by Message-ID
// (key_by::uid with view_by::folders is invalid_argument; key_by::uid
// under view_by::automatic is keyed by Message-ID when the folders are
// chosen, and on_note says so); a message without one is keyed by its UID
// in the mailbox and stays there until its claim is decided, then goes to
// Done or Failed (on_note says so). As the keywords, the folders are a
// view, moved after the store decided, never read to decide anything. A
// move that fails is tried again by its worker until half a lease after
// the decision; after that the watchers repair it: a message found in the
// mailbox or Processing whose claim is completed (failed), for a whole
// lease, is moved to Done (Failed) by one of them (a lease_mutex in the
// store, "view/<key>", keeps two watchers from moving it at once). The
// worker's tries and the watchers' repair do not take turns by a lock:
// the worker starts no try past half a lease, the watchers start a whole
// lease after seeing the claim decided, but a try already under way (its
// commands each wait up to options.timeout on a slow server) or a worker
// paused (a stopped process, a suspended machine) can run into the
// repair. Then both may copy the message (the COPY fallback; a UID MOVE
// of one UID succeeds once): at most a second copy in Done (Failed),
// never a message handled twice (the claim decides that, not the move). The repair
// moves the message by the UID its look saw it at (its Message-ID checked
// by a UID FETCH), and uses UID SEARCH HEADER Message-ID only to look in
// the destination first, or for a message no longer where it was seen; a
// search the server refuses (Exchange: US-ASCII only, NO [BADCHARSET]) is
// noted and skipped, never thrown out of next(). If a copy is in the
// destination already, a copy in Processing (left by a move a crash cut
// short between its copy and its expunge: only the view's moves put
// messages there) is removed, and so is one in the mailbox of the same
// size and INTERNALDATE (which a move and a COPY keep); one in the mailbox
// that differs (a second delivery of the Message-ID, which may be a new
// message a person must see) is moved beside it and noted, never deleted.
// Where the server lacks MOVE, the COPY's source is unmarked \Deleted
// first (a COPY copies flags, and a \Deleted copy in Done would go with
// the next purge there); if its expunge fails, the message is handled from
// its copy and the source, left \Deleted, is removed by a watcher's
// repair, never the copy (searches skip \Deleted copies). A message's
// current UID after a
// move comes from COPYUID (UIDPLUS), or else from UID SEARCH HEADER
// Message-ID. What a person moving messages by hand does:
//   - moves one from Done back to the mailbox: it is not handled again (its
//     claim is completed); a watcher moves it back to Done a lease later;
//   - moves one out of the mailbox before it is claimed (to another
//     folder, Done included): it is not handled;
//   - moves one out of Processing while it is held: its worker completes
//     the claim all the same, and the move to Done finds the message where
//     it is if that is the mailbox or Processing, or says (on_note) that it
//     cannot;
//   - puts one in Done whose claim is not completed: it is left there, and
//     a worker that claims it and finds it only there says so.
//
// One key scheme per mailbox: watchers keying its messages differently (by
// UID, by Message-ID) would each claim the same message. The first watcher
// of a mailbox writes the scheme into the store, create-if-absent
// ("mailbox/<mailbox>/keyed-by": "uid" or "message-id"; where the store
// already holds claims of the mailbox, from before this record, their
// scheme). Every watcher after it keys so: key_by::automatic adopts the
// record where its view allows (the keyword view allows both, the folder
// view needs Message-IDs); otherwise its constructor throws
// errc::invalid_argument, naming the record. So a mailbox the keyword view
// kept (keyed by UID, its handled messages still in it) is not switched to
// the folder view under the same claims: that takes stopping every watcher,
// moving the handled messages out, and a new claims folder.
#pragma once


#include <algorithm>
#include <chrono>
#include <concepts>
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
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <dibs/backoff.hpp>
#include <dibs/imap/client.hpp>
#include <dibs/imap/store.hpp>
#include <dibs/lease_mutex.hpp>
#include <dibs/marker_claim.hpp>

namespace dibs {

namespace detail {
/// Where a mailbox's claims are, for messages: the store's where()
/// ("user@host:port folder 'dibs'", "table 'dibs' in database '/srv/claims.db'").
template <class Store>
std::string claims_where(const Store& s) {
  if constexpr (requires { { s.where() } -> std::convertible_to<std::string>; }) return s.where();
  else return "the claims store";
}
}  // namespace detail

struct imap_mailbox_options {
  /// The shared mailbox the messages arrive in.
  std::string mailbox = "INBOX";
  /// What a claim is keyed by: the delivered copy (its UID) or the message
  /// (its Message-ID). automatic: the UID in the keyword view, the
  /// Message-ID in the folder view (a move gives a message a new UID).
  enum class key_by { uid, message_id, automatic } key = key_by::automatic;
  /// How a message's state is shown: by keywords on it, or by the folder it
  /// is in (see the top of this header). automatic: keywords where the
  /// mailbox keeps them (\* in the PERMANENTFLAGS of its SELECT), folders
  /// elsewhere (Exchange Online), which on_note says once.
  enum class view_by { automatic, keywords, folders } view = view_by::automatic;
  /// The folder view's folders, full names. Empty: subfolders of `mailbox`
  /// named Processing, Done and Failed, joined with the server's hierarchy
  /// delimiter (from LIST: "INBOX/Processing" on Exchange and Dovecot).
  /// Created if absent (and subscribed, for clients that show only those).
  std::string processing_folder{};
  std::string done_folder{};
  std::string failed_folder{};
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

template <listable_store Store>
class basic_imap_mailbox {
  // The folder view: where a message is: its folder, its UID there (0: not
  // known) and the folder's UIDVALIDITY then.
  struct place {
    std::string folder;
    std::uint32_t uid = 0;
    std::uint32_t validity = 0;
  };

public:
  using claims_type = marker_claim<Store>;
  using view_by = imap_mailbox_options::view_by;
  using key_by = imap_mailbox_options::key_by;

  /// A message this worker holds the claim on.
  class mail {
  public:
    mail(mail&&) noexcept = default;
    mail& operator=(mail&&) noexcept = default;

    /// Returns: the message's UID in folder() (in the folder view, 0 if a
    /// move's outcome left it unknown).
    std::uint32_t uid() const noexcept { return uid_; }
    /// Returns: the folder the message is in: the mailbox in the keyword
    /// view; in the folder view, Processing (or the mailbox, for a message
    /// without Message-ID or one whose move failed; empty if unknown).
    const std::string& folder() const noexcept { return folder_; }
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
    /// destructor, reads that it did). In the folder view: completes the
    /// claim, then moves the message to Done. Throws: as
    /// marker_claim::claim::complete; a keyword that cannot be set, or a
    /// move that fails, is only noted (the view is repaired later).
    void complete(std::string_view result = {}) {
      if (box_->folders_) {
        auto key_copy = claim_.key();
        // Taken before the store's write: the window of this worker's own
        // move (put_away) ends earlier for it, never later.
        const auto decided = std::chrono::steady_clock::now();
        claim_.complete(result);
        box_->put_away(std::move(key_copy), message_id_, {folder_, uid_, validity_}, box_->done_, decided);
        return;
      }
      claim_.complete(result);
      box_->show_ahead(validity_, uid_, box_->opts_.completed_keyword);
      box_->done(uid_);
    }

    /// Effects: gives the message back with `error` (it is failed on its
    /// last attempt, and shows $Failed, or in the folder view is moved to
    /// Failed; given back otherwise, it stays in Processing); it is handed
    /// out again after options.claims.retry_backoff (by default 0.5-1 s
    /// after the first attempt, doubling). Returns: false if the claim was
    /// taken over.
    bool release(std::string_view error) {
      if (box_->folders_) {
        const auto key_copy = claim_.key();
        const auto decided = std::chrono::steady_clock::now();
        const bool ok = claim_.release(error);
        // Moved only by the worker whose release decided it (a claim taken
        // over is the new holder's to show).
        if (ok && box_->claims_.status(key_copy).state == claim_state::failed)
          box_->put_away(key_copy, message_id_, {folder_, uid_, validity_}, box_->failed_, decided);
        box_->held_by_key_.erase(key_copy);  // claimable again, also here
        return ok;
      }
      const auto key_copy = claim_.key();
      const bool ok = claim_.release(error);
      const auto st = box_->claims_.status(key_copy);
      box_->show(validity_, uid_, st.state == claim_state::failed ? box_->opts_.failed_keyword : std::string{});
      if (st.state == claim_state::failed) box_->done(uid_);
      else box_->held_.erase(uid_);  // claimable again, also here
      return ok;
    }

  private:
    friend class basic_imap_mailbox;
    mail(basic_imap_mailbox* box, typename claims_type::claim c, std::uint32_t uid, std::string id, std::string raw)
        : box_(box), claim_(std::move(c)), validity_(box->validity_), uid_(uid), folder_(box->opts_.mailbox),
          message_id_(std::move(id)), raw_(std::move(raw)) {}
    // The folder view's: the message is at `at`.
    mail(basic_imap_mailbox* box, typename claims_type::claim c, const place& at, std::string id, std::string raw)
        : box_(box), claim_(std::move(c)), validity_(at.validity), uid_(at.uid), folder_(at.folder),
          message_id_(std::move(id)), raw_(std::move(raw)) {}
    basic_imap_mailbox* box_;
    typename claims_type::claim claim_;
    std::uint32_t validity_;  // of the mailbox (the folder view: of folder_) when the message was claimed
    std::uint32_t uid_;
    std::string folder_;
    std::string message_id_;
    std::string raw_;
  };

  /// One message of the mailbox and what the store says of it (status()).
  struct entry {
    std::uint32_t uid = 0;
    std::string key;
    std::vector<std::string> keywords;  ///< the flags shown on the message
    claim_status status;                ///< the authority
    std::string folder;                 ///< where it is (the folder view; the mailbox in the keyword view)
  };

  /// Connects (a connection of its own) and selects the mailbox; for the
  /// folder view, creates its folders where they are missing.
  /// Requires: `store` outlives this object. Throws: a refused login, the
  /// mailbox missing or read-only, naming server and mailbox;
  /// errc::invalid_argument for key_by::uid with view_by::folders (before
  /// connecting), a key scheme other than the store's record for the
  /// mailbox that key_by::automatic cannot adopt (see the top of this
  /// header; nothing is moved, claimed or created then), or folder names
  /// that are not four different folders;
  /// std::errc::not_supported for the folder view on a server with
  /// neither MOVE nor UIDPLUS.
  basic_imap_mailbox(imap::options server, Store& store, imap_mailbox_options o = {})
      : opts_(checked(std::move(o))), session_(std::move(server)), store_(&store), claims_(store, opts_.claims) {
    select();
    choose_view();
  }
  /// Reads whether the keywords last sent were set (before the connection
  /// closes); in the folder view, tries the moves this worker still owes.
  ~basic_imap_mailbox() {
    try {
      drain();
      if (folders_) pay_owed();
    } catch (...) {
    }
  }
  basic_imap_mailbox(const basic_imap_mailbox&) = delete;
  basic_imap_mailbox& operator=(const basic_imap_mailbox&) = delete;

  /// Returns: "user@host:port mailbox 'INBOX'", for messages.
  std::string where() const { return fmt::format("{} mailbox '{}'", session_.where(), opts_.mailbox); }
  claims_type& claims() noexcept { return claims_; }
  /// Returns: the view in use, keywords or folders (automatic is resolved
  /// when the mailbox is opened).
  view_by view() const noexcept { return folders_ ? view_by::folders : view_by::keywords; }
  /// Returns: what claims are keyed by, uid or message_id (the store's
  /// record for the mailbox, which key_by::automatic adopts).
  key_by keyed_by() const noexcept { return by_id_ ? key_by::message_id : key_by::uid; }
  /// Returns: the folder view's folders, full names (empty in the keyword view).
  const std::string& processing_folder() const noexcept { return processing_; }
  const std::string& done_folder() const noexcept { return done_; }
  const std::string& failed_folder() const noexcept { return failed_; }

  /// Returns: a claim on a message nobody has handled (or whose worker is
  /// gone), waiting for one with IDLE up to `wait`; nothing if none came.
  std::optional<mail> next(std::chrono::milliseconds wait) {
    const auto end = std::chrono::steady_clock::now() + wait;
    const auto wake = recheck();
    // Failures waited out back off (each try may reconnect and log in, and
    // a throttling server counts logins): 200 ms doubling to 5 s, equal
    // jitter, capped by the wait left.
    const exponential_backoff backoff{std::chrono::milliseconds{200}, 2.0, std::chrono::seconds{5}, jitter::equal};
    std::uint64_t failures = 0;
    std::uniform_real_distribution<double> unit{0.0, 1.0};
    for (;;) {
      try {
        if (auto m = folders_ ? scan_folders_and_claim() : scan_and_claim()) return m;
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
        if (left.count() <= 0) return std::nullopt;
        if (folders_) {
          use(opts_.mailbox);  // new mail arrives there
          session_.idle(std::min(left, wake));
        } else if (!held_.empty() || pending_.empty()) {
          drain();
          session_.idle(std::min(left, wake));
        }
      } catch (const std::system_error& e) {
        if (!is_transient(e.code()) && e.code() != make_error_code(errc::outcome_unknown)) throw;
        selected_ = false;
        if (!session_.connected()) recovery_.lost();
        const auto now = std::chrono::steady_clock::now();
        if (now >= end) return std::nullopt;
        std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
            backoff.delay(failures++, {}, unit(rng_)), end - now));
      }
    }
  }

  /// Returns: every message of the mailbox with its keywords and what the
  /// store says of it, in UID order (for a listing, or a check that the
  /// view agrees with the store). In the folder view: those of the
  /// mailbox, Processing, Done and Failed, in that order, each in UID
  /// order (a message without Message-ID outside the mailbox has no key:
  /// its claim was keyed by its UID there).
  std::vector<entry> status() {
    if (folders_) return folder_status();
    ready();
    const auto lines = fetch_all(1, fmt::format("listing {}", where()));
    auto states = states_now();
    std::vector<entry> out;
    for (auto& [uid, m] : parse(lines)) {
      entry e{uid, m.key, m.flags, {}, opts_.mailbox};
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
                                          "of each message there (with keywords, or by moving it to other "
                                          "folders), so it needs the right to change it",
                                          where()));
    std::uint32_t validity = 0;
    // RFC 3501 7.1: without PERMANENTFLAGS, every flag can be kept.
    keeps_keywords_ = true;
    for (const auto& u : r.untagged) {
      if (const auto at = u.find("[UIDVALIDITY "); at != std::string::npos)
        validity = static_cast<std::uint32_t>(std::stoul(u.substr(at + 13)));
      if (const auto at = u.find("[PERMANENTFLAGS "); at != std::string::npos)
        keeps_keywords_ = u.find("\\*", at) < u.find(']', at);
    }
    current_ = opts_.mailbox;
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
    const auto by_uid = uid_key(validity_, uid);
    if (!by_id_) return by_uid;
    if (message_id.empty()) {
      note(fmt::format("message UID {} in {} has no Message-ID: it is keyed by its UID ({})", uid, where(), by_uid));
      return by_uid;
    }
    return id_key(message_id);
  }

  std::string uid_key(std::uint32_t validity, std::uint32_t uid) const {
    return fmt::format("mail/{}/uid/{}/{}", opts_.mailbox, validity, uid);
  }

  std::string id_key(const std::string& message_id) const {
    auto key = fmt::format("mail/{}/id/{}", opts_.mailbox, message_id);
    if (key.size() <= key_rules::max_key_size) return key;
    // A Message-ID too long for a key (RFC 5322 sets no limit) is keyed by
    // a 128-bit digest of it, the same for every watcher.
    return fmt::format("mail/{}/id-digest/{}", opts_.mailbox, digest(message_id));
  }

  // Returns: a 128-bit digest of `s`, in hex, the same for every watcher.
  static std::string digest(std::string_view s) {
    std::uint64_t h1 = 0xcbf29ce484222325ull, h2 = 0x84222325cbf29ce4ull;
    for (const char c : s) {
      h1 = (h1 ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
      h2 = (h2 ^ static_cast<unsigned char>(c)) * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
    }
    return fmt::format("{:016x}{:016x}", h1, h2);
  }

  std::map<std::uint32_t, seen> parse(const std::vector<std::string>& untagged) {
    auto out = parse_raw(untagged);
    for (auto& [uid, s] : out) s.key = key_of(uid, s.message_id);
    return out;
  }

  // The messages of FETCH lines (fetch_items), without keys.
  static std::map<std::uint32_t, seen> parse_raw(const std::vector<std::string>& untagged) {
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
      s.message_id = message_id_of(header);
      out.emplace(uid, std::move(s));
    }
    return out;
  }

  // Returns: the msg-id of the first Message-ID field in `header` (the
  // lines of BODY[HEADER.FIELDS (MESSAGE-ID)]: "Message-ID: <a@b>\r\n",
  // possibly folded, possibly several fields): unfolded, comments and
  // whitespace outside it removed, the "<...>" form as it is (a quoted
  // local part keeps its spaces); without "<", the first word left. Empty
  // if there is none.
  static std::string message_id_of(std::string_view header) {
    // The first field, unfolded: its lines up to one that does not start with a space or tab.
    std::string value;
    const auto colon = header.find(':');
    if (colon == std::string_view::npos) return {};
    for (std::size_t at = colon + 1; at < header.size();) {
      auto eol = header.find('\n', at);
      if (eol == std::string_view::npos) eol = header.size();
      auto line = header.substr(at, eol - at);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      value += line;
      at = eol + 1;
      if (at >= header.size() || (header[at] != ' ' && header[at] != '\t')) break;
    }
    std::string word;
    int comment = 0;  // the depth of nested comments
    for (std::size_t i = 0; i < value.size(); ++i) {
      const char c = value[i];
      if (comment > 0) {
        if (c == '\\') ++i;
        else if (c == '(') ++comment;
        else if (c == ')') --comment;
        continue;
      }
      if (c == '(') {
        ++comment;
      } else if (c == '<') {
        const auto end = value.find('>', i);
        return end == std::string::npos ? std::string{} : value.substr(i, end - i + 1);
      } else if (c == ' ' || c == '\t') {
        if (!word.empty()) return word;
      } else {
        word += c;
      }
    }
    return word;
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
      if (const auto cached = read_cached(s.key)) {
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
      std::optional<typename claims_type::claim> c;
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
      if (!by_id_ || s.message_id.empty()) {
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
      // Given back unstarted: a stale sighting costs the item no attempt.
      c->give_back_unstarted("expunged before it was handled; no other copy was in the mailbox");
    }
    return std::nullopt;
  }

  // Reads message `uid` (claimed by `c`) and sends the keywords that show
  // $Processing on it, which the server sets while the message is handled.
  // Returns: the whole message, or nothing if it was expunged.
  std::optional<std::string> take(std::uint32_t uid, const seen& s, const typename claims_type::claim& c) {
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
    auto body = body_in(lines, uid);
    if (!body) return std::nullopt;
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

  // Returns: the body of message `uid` in the lines of a "UID FETCH uid
  // (UID BODY.PEEK[])", or nothing if they hold none.
  static std::optional<std::string> body_in(const std::vector<std::string>& lines, std::uint32_t uid) {
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
      if (body && !body->empty() && which.value_or(uid) == uid) return body;
    }
    return std::nullopt;
  }


  // ---- The folder view (see the top of this header) ----

  // A message the last look found in the mailbox or Processing.
  struct candidate {
    place at;
    std::string key;
    std::string message_id;
  };
  // A move this worker owes after deciding a claim: its first try failed.
  struct owed_move {
    std::string key;
    std::string message_id;
    place at;
    std::string to;
    std::chrono::steady_clock::time_point until;  // tried by this worker until then, by the watchers after
  };
  // A message seen in the mailbox or Processing with its claim decided.
  struct decided_seen {
    dibs::version version;                        // the claim's record then
    std::chrono::steady_clock::time_point since;  // first seen so
  };

  static imap_mailbox_options checked(imap_mailbox_options o) {
    if (o.view == view_by::folders && o.key == imap_mailbox_options::key_by::uid)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::imap_mailbox: mailbox '{}': key_by::uid with view_by::folders: the "
                                          "folder view moves each message, which gives it a new UID, so a claim "
                                          "keyed by its UID would not follow it; key by Message-ID "
                                          "(key_by::message_id, or key_by::automatic, the default)",
                                          o.mailbox));
    return o;
  }

  // Chooses the view (automatic: by the PERMANENTFLAGS of the mailbox's
  // SELECT) and, for the folder view, sets up its folders.
  void choose_view() {
    folders_ = opts_.view == view_by::folders || (opts_.view == view_by::automatic && !keeps_keywords_);
    by_id_ = agree_on_keys();
    if (!folders_) return;
    setup_folders();
    if (opts_.view == view_by::automatic)
      note(fmt::format("{} keeps no keywords of the client's (no \\* in the PERMANENTFLAGS of its SELECT): the "
                       "state of each message is shown by the folder it is in ('{}', '{}', '{}'), and claims are "
                       "keyed by Message-ID{}",
                       where(), processing_, done_, failed_,
                       opts_.key == key_by::uid ? " (not by UID, as options.key said: a move gives a message a new UID)"
                                                : ""));
  }

  // The store's record of how the mailbox's claims are keyed: one scheme
  // for every watcher, whatever each one's options and view.
  std::string scheme_key() const {
    auto key = fmt::format("mailbox/{}/keyed-by", opts_.mailbox);
    if (key.size() <= key_rules::max_key_size) return key;
    return fmt::format("mailbox-digest/{}/keyed-by", digest(opts_.mailbox));
  }

  // Agrees with the store's record of the mailbox's key scheme ("uid" or
  // "message-id"), creating it if absent (create-if-absent: of watchers
  // starting at once, one writes it and the others read it). An absent
  // record over claims of the mailbox (a deployment older than the record)
  // takes their scheme: Message-ID if any claim is keyed by one (a message
  // without Message-ID is keyed by its UID under either scheme), else UID.
  // Returns: true if claims are keyed by Message-ID. Throws:
  // errc::invalid_argument if the options ask for the other scheme and
  // key_by::automatic cannot adopt the record's (the folder view needs
  // Message-IDs); as the store's read and create.
  bool agree_on_keys() {
    const bool wants_id = folders_ || opts_.key == key_by::message_id;
    const std::string wanted = wants_id ? "message-id" : "uid";
    const auto key = scheme_key();
    std::string record;
    for (int round = 0; record.empty(); ++round) {
      if (auto r = store_->read(key)) {
        record = r->value;
        break;
      }
      if (round == 3)  // created and erased again between each create and read: someone is erasing it
        throw std::system_error(make_error_code(errc::contended),
                                fmt::format("dibs::imap_mailbox: {}: the record '{}' in {} of how the mailbox's "
                                            "claims are keyed was erased each time after it was created",
                                            where(), key, detail::claims_where(*store_)));
      const auto prefix = fmt::format("mail/{}/", opts_.mailbox);
      bool ids = false, uids = false;
      for (const auto& k : store_->keys(prefix)) {
        const std::string_view rest = std::string_view{k}.substr(prefix.size());
        ids = ids || rest.starts_with("id/") || rest.starts_with("id-digest/");
        uids = uids || rest.starts_with("uid/");
      }
      const std::string mine = ids ? "message-id" : uids ? "uid" : wanted;
      if (store_->create(key, mine)) record = mine;
    }
    if (record != "uid" && record != "message-id")
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::imap_mailbox: {}: the record '{}' in {} of how the mailbox's claims "
                                          "are keyed says '{}', neither 'uid' nor 'message-id'",
                                          where(), key, detail::claims_where(*store_), record));
    if (record == wanted) return wants_id;
    const bool record_id = record == "message-id";
    if (opts_.key == key_by::automatic && (!folders_ || record_id)) {
      note(fmt::format("the claims of {} are keyed by {}, as the record '{}' in {} says (the scheme of the mailbox's "
                       "first watcher), so this watcher keys them so too",
                       where(), record_id ? "Message-ID" : "UID", key, detail::claims_where(*store_)));
      return record_id;
    }
    const std::string mine = folders_ ? "the folder view, which keys by Message-ID (a move gives a message a new UID)"
                                      : fmt::format("options.key, key_by::{}", wanted == "uid" ? "uid" : "message_id");
    throw std::system_error(
        make_error_code(errc::invalid_argument),
        fmt::format("dibs::imap_mailbox: {}: its claims are keyed by {} (the record '{}' in {}, written by the "
                    "mailbox's first watcher), but this watcher would key them by {}, for {}: watchers keying one "
                    "mailbox differently would each claim the same message, so it is refused. {}",
                    where(), record, key, detail::claims_where(*store_), wanted, mine,
                    folders_ ? fmt::format("Keep the keyword view (view_by::keywords, on a server that keeps "
                                           "keywords), or stop every watcher of the mailbox, move the messages it "
                                           "handled out of '{}', and start the folder view with new claims (a new "
                                           "imap_store_options::folder, or a new table or store)",
                                           opts_.mailbox)
                             : std::string{"Use key_by::automatic, which adopts the record's scheme"}));
  }

  void setup_folders() {
    if (!session_.has("MOVE") && !session_.has("UIDPLUS"))
      throw std::system_error(std::make_error_code(std::errc::not_supported),
                              fmt::format("dibs::imap_mailbox: {}: the server has neither MOVE (RFC 6851) nor UIDPLUS "
                                          "(RFC 4315), so the folder view could move a message only by COPY and an "
                                          "EXPUNGE of every message marked \\Deleted in its folder, a person's among "
                                          "them; use view_by::keywords, or a server with either",
                                          where()));
    std::string delimiter;
    if (opts_.processing_folder.empty() || opts_.done_folder.empty() || opts_.failed_folder.empty()) {
      const auto r = session_.run(fmt::format("LIST \"\" {}", imap::quote(opts_.mailbox)));
      recovery_.check(session_, r, fmt::format("asking for the hierarchy delimiter of {}", where()));
      for (const auto& u : r.untagged) {
        const auto v = imap::parse(u);
        if (v.size() >= 4 && v[0].is("LIST") && v[2].kind == imap::value::kind::string) delimiter = v[2].text;
      }
      if (delimiter.empty())
        throw std::system_error(make_error_code(errc::invalid_argument),
                                fmt::format("dibs::imap_mailbox: {}: the server keeps no folder hierarchy (its LIST "
                                            "names no delimiter), so the folder view has no subfolders of the mailbox "
                                            "to use: name its folders in processing_folder, done_folder and "
                                            "failed_folder",
                                            where()));
    }
    const auto name = [&](const std::string& given, std::string_view leaf) {
      return given.empty() ? fmt::format("{}{}{}", opts_.mailbox, delimiter, leaf) : given;
    };
    processing_ = name(opts_.processing_folder, "Processing");
    done_ = name(opts_.done_folder, "Done");
    failed_ = name(opts_.failed_folder, "Failed");
    if (std::set<std::string>{opts_.mailbox, processing_, done_, failed_}.size() != 4)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::imap_mailbox: {}: the folder view needs four different folders, but "
                                          "they are: mailbox '{}', processing_folder '{}', done_folder '{}', "
                                          "failed_folder '{}'",
                                          where(), opts_.mailbox, processing_, done_, failed_));
    for (const auto* folder : {&processing_, &done_, &failed_}) make_folder(*folder);
  }

  // Creates `folder` unless it is there (another watcher may create it at
  // the same moment: then it is there when asked).
  void make_folder(const std::string& folder) {
    const auto r = session_.run("CREATE " + imap::quote(folder));
    if (r.ok()) {
      // Some clients (Thunderbird, by default) show only subscribed folders.
      (void)session_.run("SUBSCRIBE " + imap::quote(folder));
      return;
    }
    const auto listed = session_.run(fmt::format("LIST \"\" {}", imap::quote(folder)));
    for (const auto& u : listed.untagged)
      if (imap::detail::istarts_with(u, "LIST ")) return;
    recovery_.check(session_, r, fmt::format("creating folder '{}' for the folder view of {}", folder, where()));
  }

  // Selects `folder` unless it is the one selected (made again if a person
  // deleted it). Returns: its UIDVALIDITY.
  std::uint32_t use(const std::string& folder) {
    if (folder == opts_.mailbox) {
      if (!session_.connected() || !selected_ || current_ != folder) select();
      return validity_;
    }
    if (session_.connected() && selected_ && current_ == folder) return current_validity_;
    selected_ = false;
    auto r = session_.run("SELECT " + imap::quote(folder));
    if (!r.ok() && r.status == "NO" && (session_code(r) || r.text.find("exist") != std::string::npos)) {
      make_folder(folder);
      r = session_.run("SELECT " + imap::quote(folder));
    }
    recovery_.check(session_, r, fmt::format("selecting folder '{}' of {}", folder, session_.where()));
    current_validity_ = 0;
    for (const auto& u : r.untagged)
      if (const auto at = u.find("[UIDVALIDITY "); at != std::string::npos)
        current_validity_ = static_cast<std::uint32_t>(std::stoul(u.substr(at + 13)));
    current_ = folder;
    selected_ = true;
    recovery_.reconnected();
    return current_validity_;
  }

  void note_once(std::string what) {
    if (noted_.insert(what).second) note(what);
  }

  // As scan_and_claim(), for the folder view: the moves this worker owes
  // first, then the messages of the last look while it is recent.
  std::optional<mail> scan_folders_and_claim() {
    pay_owed();
    if (!candidates_.empty() && std::chrono::steady_clock::now() - looked_ < recheck())
      if (auto m = claim_from_folders()) return m;
    look();
    return claim_from_folders();
  }

  // Learns the messages in Processing and in the mailbox (selected last:
  // IDLE waits for new mail there). Each look reads both whole: messages
  // leave them when they are done, so they hold only the work not done.
  void look() {
    std::vector<candidate> found;
    std::set<std::tuple<std::string, std::uint32_t, std::uint32_t>> present;
    for (const auto* folder : {&processing_, &opts_.mailbox}) {
      const auto validity = use(*folder);
      const auto lines = fetch_all(1, fmt::format("looking for work in folder '{}' of {}", *folder, session_.where()));
      for (auto& [uid, s] : parse_raw(lines)) {
        present.insert({*folder, validity, uid});
        candidate c{{*folder, uid, validity}, {}, s.message_id};
        if (!s.message_id.empty()) {
          c.key = id_key(s.message_id);
        } else if (*folder == opts_.mailbox) {
          c.key = uid_key(validity, uid);
          note_once(fmt::format("message UID {} in {} has no Message-ID: it is keyed by its UID ({}), and stays in "
                                "the mailbox while it is handled (a move would give it a new UID); it goes to '{}' "
                                "or '{}' when its claim is decided",
                                uid, where(), c.key, done_, failed_));
        } else {
          note_once(fmt::format("message UID {} in folder '{}' of {} has no Message-ID, so no claim can be matched "
                                "to it (a person put it there?): it is left there, not handled; move it to the "
                                "mailbox to have it handled",
                                uid, *folder, session_.where()));
          continue;
        }
        found.push_back(std::move(c));
      }
    }
    candidates_ = std::move(found);
    std::erase_if(decided_, [&](const auto& d) { return !present.count(d.first); });
    const auto now = std::chrono::steady_clock::now();
    std::erase_if(held_by_key_, [&](const auto& h) { return h.second <= now; });
    looked_ = now;
  }

  // As claim_known(), for the folder view.
  std::optional<mail> claim_from_folders() {
    auto order = candidates_;
    std::shuffle(order.begin(), order.end(), rng_);  // workers spread over the backlog
    const auto now = std::chrono::steady_clock::now();
    for (const auto& c : order) {
      const auto held = held_by_key_.find(c.key);
      if (held != held_by_key_.end() && held->second > now) continue;  // someone else's, looked at lately
      // What the store said at its last look spares a claim attempt (see claim_known()).
      if (const auto cached = read_cached(c.key)) {
        const auto state = detail::field(cached->value, "state");
        if (state == "completed" || state == "failed") {
          decided(c, state == "completed" ? claim_state::completed : claim_state::failed, cached->version);
          continue;
        }
        if (state == "processing" && held == held_by_key_.end()) {
          held_by_key_[c.key] = now + recheck();
          continue;
        }
      }
      std::optional<typename claims_type::claim> claim;
      try {
        claim = claims_.try_claim(c.key);
      } catch (const std::system_error& e) {
        if (is_transient(e.code()) || e.code() == make_error_code(errc::outcome_unknown)) throw;
        note(fmt::format("message UID {} in folder '{}' of {} cannot be claimed: {}", c.at.uid, c.at.folder,
                         session_.where(), e.what()));
        held_by_key_[c.key] = now + recheck();
        continue;
      }
      if (!claim) {
        const auto st = claims_.status(c.key);
        if (st.state == claim_state::completed || st.state == claim_state::failed) decided(c, st.state, st.version);
        else held_by_key_[c.key] = now + recheck();
        continue;
      }
      // Looked at again after `recheck` if it is given back (or dropped).
      held_by_key_[c.key] = now + recheck();
      std::erase_if(candidates_, [&](const candidate& other) { return other.key == c.key; });
      if (auto m = take_from_folders(c, *claim)) return m;
    }
    return std::nullopt;
  }

  // Reads the message of `claim`, where the last look found it or, if it
  // has moved since, where its Message-ID is now, and moves it from the
  // mailbox to Processing. Returns: the mail; nothing if the message is in
  // neither (its claim then ends as in the keyword view: completed for a
  // message keyed by its UID, which is gone for good; given back for one
  // keyed by its Message-ID, which may come back).
  std::optional<mail> take_from_folders(const candidate& c, typename claims_type::claim& claim) {
    std::vector<place> tries{c.at};
    for (int round = 0; round < 2 && !tries.empty(); ++round) {
      for (const auto& at : tries) {
        if (use(at.folder) != at.validity) continue;  // the folder was made again: its UIDs name other messages
        auto r = session_.run(fmt::format("UID FETCH {} (UID BODY.PEEK[])", at.uid));
        recovery_.check(session_, r,
                        fmt::format("reading message UID {} in folder '{}' of {}", at.uid, at.folder,
                                    session_.where()));
        auto raw = body_in(r.untagged, at.uid);
        if (!raw) continue;
        const auto now_at = at.folder == opts_.mailbox && !c.message_id.empty() ? hold(at, c.message_id) : at;
        return mail{this, std::move(claim), now_at, c.message_id, std::move(*raw)};
      }
      tries.clear();
      // Moved since the look (by a worker that gave it back in Processing, or by a person).
      if (round == 0 && !c.message_id.empty())
        for (const auto* folder : {&processing_, &opts_.mailbox})
          if (auto found = find_or_note(*folder, c.message_id))
            for (auto& p : *found)
              if (p.folder != c.at.folder || p.uid != c.at.uid) tries.push_back(std::move(p));
    }
    if (c.message_id.empty()) {
      note(fmt::format("message UID {} in {} was expunged before it was handled", c.at.uid, where()));
      claim.complete("expunged before it was handled");
      return std::nullopt;
    }
    const auto found_in_done = find_or_note(done_, c.message_id);
    const bool in_done = found_in_done && !found_in_done->empty();
    note(fmt::format("message {} of {} is in neither the mailbox nor '{}'{}: its claim is given back, and it is "
                     "handed out when it comes back",
                     c.message_id, where(), processing_,
                     in_done ? fmt::format(" but in '{}', though its claim is not completed (a person put it there?); "
                                           "it is left there",
                                           done_)
                             : std::string{}));
    // Given back unstarted: a claim won on a stale sighting (the message
    // moved away since the look) costs the item no attempt; otherwise N
    // watchers, each holding the sighting, would fail it.
    claim.give_back_unstarted("not in the mailbox or Processing when it was claimed");
    return std::nullopt;
  }

  // Moves message `at` (claimed and read) from the mailbox to Processing.
  // Returns: where it is now; `at` if the move failed before it was sent
  // or was refused (it is handled where it is); a place with no folder if
  // a failure left that unknown (it is looked for by its Message-ID when
  // it is done).
  place hold(const place& at, const std::string& message_id) {
    try {
      const auto moved = move_one(at, processing_);
      if (!moved) return {};  // gone between the read and the move (a person moved it)
      if (moved->uid != 0) return *moved;
      if (auto found = find(processing_, message_id); !found.empty()) return found.front();  // no UIDPLUS
      return {};
    } catch (const std::system_error& e) {
      selected_ = false;
      if (!session_.connected()) recovery_.lost();
      const bool unknown = e.code() == make_error_code(errc::outcome_unknown);
      note(fmt::format("could not move message UID {} ({}) of {} to '{}' ({}): it is handled all the same{}", at.uid,
                       message_id, where(), processing_, e.what(),
                       unknown ? ", and looked for by its Message-ID when it is done" : ", where it is"));
      return unknown ? place{} : at;
    }
  }

  // Returns: the destination's UIDVALIDITY and UID in a COPYUID response
  // code (RFC 4315: the tagged OK of a COPY; an untagged OK before the
  // EXPUNGEs of a MOVE, RFC 6851), for one message.
  static std::optional<place> copyuid(const imap::reply& r, const std::string& to) {
    std::vector<std::string> codes{r.code};
    for (const auto& u : r.untagged)
      if (imap::detail::istarts_with(u, "OK [")) codes.push_back(u.substr(4, u.find(']') - 4));
    for (const auto& code : codes) {
      const auto v = imap::parse(code);
      if (v.size() < 4 || !v[0].is("COPYUID")) continue;
      const auto validity = v[1].number();
      const auto uid = v[3].number();
      if (validity && uid && *validity <= imap::detail::max_number && *uid <= imap::detail::max_number)
        return place{to, static_cast<std::uint32_t>(*uid), static_cast<std::uint32_t>(*validity)};
    }
    return std::nullopt;
  }

  // Moves message `at` to `to`: UID MOVE, or UID COPY and the removal of
  // that one message (UIDPLUS). Returns: where it is now (UID 0: the server
  // did not say, having no UIDPLUS), or nothing if it was not there.
  // Throws: as session::run_write (errc::outcome_unknown if the reply was
  // lost), or naming the server's refusal.
  std::optional<place> move_one(const place& at, const std::string& to) {
    if (use(at.folder) != at.validity) return std::nullopt;
    const bool move = session_.has("MOVE");
    // UID COPY copies the flags: the copy must not be \Deleted (a purge of its folder would remove it).
    if (!move)
      recovery_.check(session_,
                      session_.run_write({fmt::format("UID STORE {} -FLAGS.SILENT (\\Deleted)", at.uid)}).front(),
                      fmt::format("clearing \\Deleted on message UID {} in folder '{}' of {} before copying it",
                                  at.uid, at.folder, session_.where()));
    const auto command = fmt::format("UID {} {} {}", move ? "MOVE" : "COPY", at.uid, imap::quote(to));
    auto r = session_.run_write({command}).front();
    if (!r.ok() && imap::detail::iequals(r.code, "TRYCREATE")) {  // a person deleted the folder
      make_folder(to);
      r = session_.run_write({command}).front();
    }
    if (!r.ok() && imap::detail::istarts_with(r.code, "EXPUNGEISSUED")) return std::nullopt;
    recovery_.check(session_, r,
                    fmt::format("moving message UID {} from '{}' to '{}' of {}", at.uid, at.folder, to,
                                session_.where()));
    auto moved = copyuid(r, to);
    // With UIDPLUS, no COPYUID: nothing was copied ("OK No messages found").
    if (!moved && session_.has("UIDPLUS")) return std::nullopt;
    if (!move) {
      try {
        expunge_one(at);
      } catch (const std::system_error& e) {
        if (!moved) throw;
        // The copy is made and known: it is where the message is now. The
        // source, marked \Deleted, is left; the watchers' repair removes it
        // (a copy of its Message-ID is where it belongs), never the copy.
        selected_ = false;
        if (!session_.connected()) recovery_.lost();
        note(fmt::format("copied message UID {} from '{}' to '{}' of {} (UID {} there), but could not remove the "
                         "source ({}): it is left marked \\Deleted, and removed by a watcher's repair",
                         at.uid, at.folder, to, session_.where(), moved->uid, e.what()));
      }
    }
    return moved ? *moved : place{to, 0, 0};
  }

  // Removes message `at` (and no other: UID EXPUNGE, UIDPLUS; a plain
  // EXPUNGE would also remove what a person marked \Deleted).
  void expunge_one(const place& at) {
    if (!session_.has("UIDPLUS")) {
      note(fmt::format("message UID {} in folder '{}' of {} is a second copy, but the server has no UIDPLUS to remove "
                       "it alone: it is left there",
                       at.uid, at.folder, session_.where()));
      return;
    }
    if (use(at.folder) != at.validity) return;
    // One after the other, not pipelined: Dovecot runs a UID EXPUNGE beside
    // a UID STORE sent with it, and may expunge before the flag is set
    // (seen: a message left \Deleted).
    const auto what =
        fmt::format("removing message UID {} from folder '{}' of {}", at.uid, at.folder, session_.where());
    for (const auto& command : {fmt::format("UID STORE {} +FLAGS.SILENT (\\Deleted)", at.uid),
                                fmt::format("UID EXPUNGE {}", at.uid)})
      recovery_.check(session_, session_.run_write({command}).front(), what);
  }

  // Returns: where in `folder` the messages with Message-ID `message_id`
  // are (SEARCH HEADER matches a part of the header: each found is
  // compared whole).
  std::vector<place> find(const std::string& folder, const std::string& message_id) {
    const auto validity = use(folder);
    const auto what = fmt::format("looking for message {} in folder '{}' of {}", message_id, folder, session_.where());
    // UNDELETED: a copy marked \Deleted is a COPY's source left behind, not a place the message is.
    const auto r = session_.run(fmt::format("UID SEARCH UNDELETED HEADER Message-ID {}", imap::quote(message_id)));
    recovery_.check(session_, r, what);
    std::vector<std::uint32_t> uids;
    for (const auto& u : r.untagged) {
      const auto v = imap::parse(u);
      if (v.empty() || !v[0].is("SEARCH")) continue;
      for (std::size_t i = 1; i < v.size(); ++i)
        if (const auto n = v[i].number(); n && *n <= imap::detail::max_number)
          uids.push_back(static_cast<std::uint32_t>(*n));
    }
    if (uids.empty()) return {};
    std::sort(uids.begin(), uids.end());
    const auto f = session_.run(fmt::format("UID FETCH {} {}", imap::detail::uid_set(uids), fetch_items));
    recovery_.check(session_, f, what);
    std::vector<place> out;
    for (const auto& [uid, s] : parse_raw(f.untagged))
      if (s.message_id == message_id && std::binary_search(uids.begin(), uids.end(), uid))
        out.push_back({folder, uid, validity});
    return out;
  }

  // The claim of `key` was decided by this worker at `decided`: its
  // message goes to `to` now or, if that fails, with this worker's next
  // looks, a try started no later than half a lease after the decision;
  // after that the watchers' repair moves it, a whole lease after they saw
  // it decided (a try under way, or a paused worker, can still overlap the
  // repair: at most a second copy in `to`; see the top of this header).
  void put_away(std::string key, std::string message_id, place at, const std::string& to,
                std::chrono::steady_clock::time_point decided) {
    held_by_key_.erase(key);
    owed_move m{std::move(key), std::move(message_id), std::move(at), to, decided + opts_.claims.lease / 2};
    if (!try_move(m, true)) owed_.push_back(std::move(m));
  }

  // Returns: true if the move is done (or there was nothing to move).
  bool try_move(const owed_move& m, bool first) {
    try {
      // Tried again after a failure, whose move may have been half done (a
      // server's crash between its copy and its expunge): looked for, and a
      // copy already in `to` kept.
      finish_move(m.message_id, first || m.message_id.empty() ? m.at : place{}, m.to);
      return true;
    } catch (const std::system_error& e) {
      selected_ = false;
      if (!session_.connected()) recovery_.lost();
      if (first)
        note(fmt::format("could not move message {} of {} to '{}' ({}): tried again with this worker's next looks, "
                         "and by the watchers after that",
                         shown(m.message_id, m.at), where(), m.to, e.what()));
      return false;
    }
  }

  void pay_owed() {
    if (owed_.empty()) return;
    const auto now = std::chrono::steady_clock::now();
    for (auto owed = std::exchange(owed_, {}); auto& m : owed) {
      if (now >= m.until) {
        note(fmt::format("message {} of {} is left for the watchers to move to '{}': this worker could not within "
                         "half a lease of deciding its claim",
                         shown(m.message_id, m.at), where(), m.to));
        continue;
      }
      if (!try_move(m, false)) owed_.push_back(std::move(m));
    }
  }

  static std::string shown(const std::string& message_id, const place& at) {
    return message_id.empty() ? fmt::format("UID {} in folder '{}'", at.uid, at.folder) : message_id;
  }

  // Puts the message of a decided claim in `to`: one copy there, none left
  // in the mailbox or Processing. `at`: where its worker's own move put it
  // (one command). Otherwise, or if it is not there, it is looked for by
  // its Message-ID: a copy already in `to` is kept, and the others removed.
  void finish_move(const std::string& message_id, const place& at, const std::string& to) {
    if (!at.folder.empty() && at.uid != 0 && move_one(at, to)) return;
    if (message_id.empty()) {
      note(fmt::format("message UID {} is no longer in folder '{}' of {} to be moved to '{}' (a person moved it?): it "
                       "is left where it is",
                       at.uid, at.folder, session_.where(), to));
      return;
    }
    const auto in_to = find_or_note(to, message_id);
    if (!in_to) return;  // noted; the watchers' repair moves it by the UID it is seen at
    bool there = !in_to->empty();
    for (const auto* folder : {&processing_, &opts_.mailbox}) {
      const auto found = find_or_note(*folder, message_id);
      if (!found) continue;
      for (const auto& p : *found) {
        if (!there) {
          there = move_one(p, to).has_value();
        } else if (*folder == processing_ || same_as_any(p, find_or_note(to, message_id).value_or(std::vector<place>{}))) {
          expunge_one(p);  // a move cut short left it (only the view's moves put messages in Processing)
        } else {
          note(fmt::format("message UID {} in {} has the Message-ID {} of a message in '{}' already, but another "
                           "size or arrival time (delivered twice?): moved there beside it, not deleted",
                           p.uid, where(), message_id, to));
          move_one(p, to);
        }
      }
    }
    if (!there)
      note(fmt::format("message {} is in neither the mailbox nor '{}' of {} to be moved to '{}' (a person moved it "
                       "elsewhere?): it is left where it is",
                       message_id, processing_, where(), to));
  }

  // A message the last look found in the mailbox or Processing whose claim
  // is decided (its record's version `record`): moved by the watchers'
  // repair once one of them has seen it so for a whole lease (its own
  // worker's move has had its time by then: half a lease from the
  // decision).
  void decided(const candidate& c, claim_state state, dibs::version record) {
    const auto now = std::chrono::steady_clock::now();
    auto [it, fresh] =
        decided_.try_emplace(std::tuple{c.at.folder, c.at.validity, c.at.uid}, decided_seen{record, now});
    if (!fresh && it->second.version != record) it->second = {record, now};
    if (fresh || now - it->second.since < opts_.claims.lease) return;
    decided_.erase(it);
    repair(c, state);
  }

  // One watcher at a time (a lease in the store, per message) moves a
  // message whose claim is decided to where it belongs.
  void repair(const candidate& c, claim_state state) {
    auto key = "view/" + c.key;
    if (key.size() > key_rules::max_key_size) key = "view-digest/" + digest(c.key);
    lease_mutex<Store> lock{*store_, key, {.lease = opts_.claims.lease}};
    if (!lock.try_lock()) return;  // another watcher is at it
    const auto& to = state == claim_state::completed ? done_ : failed_;
    note(fmt::format("message {} of {} has been {} for a lease: moved to '{}' (a person moved it back, or its "
                     "worker could not); it is not handled again",
                     shown(c.message_id, c.at), session_.where(), to_string(state), to));
    if (c.message_id.empty()) finish_move(c.message_id, c.at, to);
    else repair_move(c, to);
    lock.unlock();
  }

  // The repair's move of `c` (a message with a Message-ID) to `to`, by the
  // UID the look saw it at (its Message-ID checked by a UID FETCH), so that
  // it needs no SEARCH, which some servers refuse or get wrong (Exchange:
  // US-ASCII only); only a message no longer there is looked for by its
  // Message-ID. A copy already in `to`: the one seen is removed if it is
  // in Processing (only the view's moves put messages there: a move cut
  // short between its copy and its expunge left it), else moved beside it
  // (a second delivery, which a person may want: never deleted).
  void repair_move(const candidate& c, const std::string& to) {
    bool deleted = false;
    if (!holds(c.at, c.message_id, &deleted)) {
      finish_move(c.message_id, place{}, to);
      return;
    }
    const auto in_to = find_or_note(to, c.message_id);
    if (deleted) {
      // The source of a COPY whose expunge failed (dibs marks \Deleted only
      // after its copy is made): removed where a copy is in `to`.
      if (in_to && !in_to->empty()) expunge_one(c.at);
      else
        note(fmt::format("message UID {} in folder '{}' of {} is marked \\Deleted and no copy of it ({}) was found in "
                         "'{}': it is left where it is",
                         c.at.uid, c.at.folder, session_.where(), c.message_id, to));
      return;
    }
    if (in_to && !in_to->empty() && c.at.folder == processing_) {
      expunge_one(c.at);
      return;
    }
    if (in_to && !in_to->empty()) {
      if (same_as_any(c.at, *in_to)) {
        expunge_one(c.at);  // the source of a move a crash cut short: the same message is in `to`
        return;
      }
      note(fmt::format("message UID {} in {} has the Message-ID {} of a message in '{}' already, but another size or "
                       "arrival time (delivered twice?): moved there beside it, not deleted",
                       c.at.uid, where(), c.message_id, to));
    }
    move_one(c.at, to);
  }

  // Returns: the size and INTERNALDATE of message `at` ("" if it is gone).
  // A move (and COPY) keeps both; a second delivery has its own arrival time.
  std::string identity(const place& at) {
    if (use(at.folder) != at.validity) return {};
    const auto r = session_.run(fmt::format("UID FETCH {} (UID RFC822.SIZE INTERNALDATE)", at.uid));
    recovery_.check(session_, r,
                    fmt::format("reading message UID {} in folder '{}' of {}", at.uid, at.folder, session_.where()));
    for (const auto& line : r.untagged) {
      const auto v = imap::parse(line);
      if (v.size() < 3 || !v[1].is("FETCH") || v[2].kind != imap::value::kind::list) continue;
      std::string size, date;
      std::uint64_t uid = 0;
      const auto& items = v[2].items;
      for (std::size_t i = 0; i + 1 < items.size(); i += 2) {
        if (items[i].is("UID")) uid = items[i + 1].number().value_or(0);
        else if (items[i].is("RFC822.SIZE")) size = std::to_string(items[i + 1].number().value_or(0));
        else if (items[i].is("INTERNALDATE")) date = items[i + 1].text;
      }
      if (uid == at.uid && !size.empty() && !date.empty()) return size + " " + date;
    }
    return {};
  }

  // Returns: whether message `at` is the same message as one of `others`
  // (the same size and INTERNALDATE: a copy a move or COPY made), so that
  // removing it loses nothing.
  bool same_as_any(const place& at, const std::vector<place>& others) {
    const auto mine = identity(at);
    if (mine.empty()) return false;
    return std::any_of(others.begin(), others.end(), [&](const place& p) { return identity(p) == mine; });
  }

  // Returns: whether message `at` is there and has Message-ID `message_id`
  // (`deleted`, if given: whether it is marked \Deleted).
  bool holds(const place& at, const std::string& message_id, bool* deleted = nullptr) {
    if (at.folder.empty() || at.uid == 0 || use(at.folder) != at.validity) return false;
    const auto r = session_.run(fmt::format("UID FETCH {} {}", at.uid, fetch_items));
    recovery_.check(session_, r,
                    fmt::format("reading message UID {} in folder '{}' of {}", at.uid, at.folder, session_.where()));
    const auto found = parse_raw(r.untagged);
    const auto it = found.find(at.uid);
    if (it == found.end() || it->second.message_id != message_id) return false;
    if (deleted) *deleted = has_flag(it->second, "\\Deleted");
    return true;
  }

  // find(), where a search the server refuses (NO [BADCHARSET] for a
  // Message-ID that is not US-ASCII, as Exchange answers; any error that
  // is not transient) costs only this message: noted. Returns: nothing
  // then. Throws: transient errors and errc::outcome_unknown, as find().
  std::optional<std::vector<place>> find_or_note(const std::string& folder, const std::string& message_id) {
    try {
      return find(folder, message_id);
    } catch (const std::system_error& e) {
      if (is_transient(e.code()) || e.code() == make_error_code(errc::outcome_unknown)) throw;
      note(fmt::format("could not look for message {} in folder '{}' of {} ({}): skipped; a repair moves it by the "
                       "UID it was seen at",
                       message_id, folder, session_.where(), e.what()));
      return std::nullopt;
    }
  }

  // status() in the folder view.
  std::vector<entry> folder_status() {
    const auto states = states_now();
    std::vector<entry> out;
    for (const auto* folder : {&opts_.mailbox, &processing_, &done_, &failed_}) {
      const auto validity = use(*folder);
      const auto lines = fetch_all(1, fmt::format("listing folder '{}' of {}", *folder, session_.where()));
      for (auto& [uid, s] : parse_raw(lines)) {
        entry e{uid, {}, std::move(s.flags), {}, *folder};
        if (!s.message_id.empty()) e.key = id_key(s.message_id);
        else if (*folder == opts_.mailbox) e.key = uid_key(validity, uid);
        if (const auto it = states.find(e.key); it != states.end()) e.status = it->second;
        out.push_back(std::move(e));
      }
    }
    return out;
  }

  // What the store read last for `key`, without a round trip, where it
  // keeps that (imap_store: the claims folder's messages at hand); else
  // nothing, and the claim is tried.
  std::optional<record> read_cached(std::string_view key) {
    if constexpr (requires(Store& st) { { st.read_cached(key) } -> std::same_as<std::optional<record>>; })
      return store_->read_cached(key);
    else
      return std::nullopt;
  }

  imap_mailbox_options opts_;
  imap::session session_;
  Store* store_;
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
  bool keeps_keywords_ = true;  // \* in the mailbox's PERMANENTFLAGS
  bool by_id_ = false;          // claims keyed by Message-ID
  // The folder view's.
  bool folders_ = false;
  std::string processing_, done_, failed_;
  std::string current_;                   // the folder selected
  std::uint32_t current_validity_ = 0;    // its UIDVALIDITY (the mailbox's is validity_)
  std::vector<candidate> candidates_;     // the last look's
  std::map<std::string, std::chrono::steady_clock::time_point> held_by_key_;
  std::vector<owed_move> owed_;
  // By (folder, UIDVALIDITY, UID).
  std::map<std::tuple<std::string, std::uint32_t, std::uint32_t>, decided_seen> decided_;
  std::set<std::string> noted_;           // notes said once
};

/// The mailbox with its claims in an IMAP folder (imap_store), which needs
/// a server with UIDPLUS and QRESYNC.
using imap_mailbox = basic_imap_mailbox<imap_store>;

}  // namespace dibs
