#!/usr/bin/env bash
# A throwaway Dovecot IMAP server on loopback, for dibs's tests, benchmarks
# and demo (dibs::imap). Plain IMAP on a free 127.0.0.1 port (TLS as well
# with --tls, below), two users, sdbox mailboxes, its own standalone
# DIR/dovecot.conf: nothing of /etc/dovecot is read, and other Dovecots on
# the machine are left alone.
#
#   scripts/imap.sh start DIR [--tls]
#                                write DIR/dovecot.conf, start on a free port
#                                with empty mailboxes, wait until a LOGIN works;
#                                prints DIR/env. --tls: TLS as well (below)
#   scripts/imap.sh stop DIR     SIGTERM the master, wait until all its processes
#                                are gone (succeeds if none runs); DIR is kept
#   scripts/imap.sh kill DIR     SIGKILL the master and all its processes (a crash),
#                                wait until they are gone
#   scripts/imap.sh restart DIR  start again on the same port and the same mail
#   scripts/imap.sh env DIR      prints DIR/env
#
# DIR/env holds lines a shell can source (`set -a; . DIR/env; set +a`):
#   DIBS_IMAP_HOST=127.0.0.1 DIBS_IMAP_PORT=N DIBS_IMAP_USER=dibs
#   DIBS_IMAP_PASSWORD=dibs-secret DIBS_IMAP_OAUTH2_KEY=BASE64
# Two more users are there: `other` (password `other-secret`) and `third`
# (`third-secret`).
#
# Logins: LOGIN and AUTHENTICATE PLAIN with the passwords; AUTHENTICATE
# XOAUTH2 and OAUTHBEARER (SASL-IR announced, as Dovecot does) with OAuth2
# access tokens, which Dovecot's oauth2 passdb validates locally
# (introspection_mode = local, Dovecot 2.3.11 and later): a JWT signed
# HS256 with the key DIBS_IMAP_OAUTH2_KEY (32 random bytes, base64, made
# with the openssl CLI at each start, kept in HOME/oauth2/keys), whose
# "sub" is the user logging in and whose "exp" has not passed (no "kid",
# no "azp"). `dibs` is a master user (a master passdb): AUTHENTICATE PLAIN
# with authorization identity `other`, authentication identity `dibs` and
# dibs's password logs into other's mailbox; `third` is no master user, so
# the same with `third` is refused. With a token the same is done in
# Dovecot's master-user form (auth_master_user_separator = *): XOAUTH2's
# user= (OAUTHBEARER's a=) `other*dibs` and a token of dibs's log into
# other's mailbox (a master oauth2 passdb takes only tokens whose "sub" is
# dibs; then a passdb with random passwords no one knows, for the mechanisms
# of tokens, says other exists); Dovecot 2.3 has no other way for a token
# of one user into another's mailbox: user=other with dibs's token is
# refused ("Username 'other' did not match 'dibs'"), as is `other*third`
# with third's. Failed logins are answered without
# Dovecot's delay (auth_failure_delay = 0, no auth penalty per address),
# so that the tests of refusals take no seconds.
#
# --tls: a test CA and a server certificate it signed, made with the openssl
# CLI in HOME/tls (ca.crt; server.crt and server.key, EC P-256, for the IP
# address 127.0.0.1 only: connecting as "localhost" is a host name mismatch,
# which the tests use). Dovecot gets `ssl = yes` (STARTTLS on the plain port,
# which otherwise stays as it is) and an imaps listener (TLS from the first
# byte) on a second free port; DIR/env has two more lines:
#   DIBS_IMAP_TLS_PORT=N DIBS_IMAP_CA_FILE=HOME/tls/ca.crt
# Dovecot reads ssl_cert and ssl_key (`<file`) in its config process, which
# runs as the user that started it (root: the key stays 0600 root's).
#
# The server's own files (base_dir with its unix sockets, state_dir, the mail
# and the passwd-file) live in DIR, or, when DIR is too long for a unix
# socket path (108 bytes), is not reachable by the mail user (a DIR under
# /root) or has characters a dovecot.conf value cannot hold, in
# /tmp/dibs-imap-<hash> (named in DIR/home). DIR/dovecot.log is the log.
# When run as root, the mail and Dovecot's internal processes run as a system
# user `dibs-mail`, made once, and the login processes as `dovenull` (from the
# dovecot-core package); otherwise everything runs as this user.
set -euo pipefail

die() { echo "imap.sh: $*" >&2; exit 1; }

command -v dovecot >/dev/null 2>&1 || [ -x /usr/sbin/dovecot ] ||
  die "no Dovecot found (apt-get install dovecot-imapd)"
dovecot_bin=$(command -v dovecot 2>/dev/null || echo /usr/sbin/dovecot)

is_root() { [ "$(id -u)" -eq 0 ]; }

ensure_mail_user() {
  is_root || return 0
  id -u dibs-mail >/dev/null 2>&1 ||
    useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin dibs-mail
}

# The user the mail (and Dovecot's internal processes) run as.
mail_user() { if is_root; then echo dibs-mail; else id -un; fi; }

# Whether the mail user can reach directory $1.
reachable() {
  if is_root; then runuser -u dibs-mail -- test -x "$1" 2>/dev/null; else test -x "$1"; fi
}

# Where the server's own files go (see the header), recorded in DIR/home.
choose_home() {  # DIR
  local dir=$1 short
  short=/tmp/dibs-imap-$(printf '%s:%s' "$(id -u)" "$dir" | sha256sum | cut -c1-12)
  # The longest socket under base_dir is token-login/imap-urlauth: 24 bytes.
  if [ ${#dir} -le 64 ] && [[ $dir =~ ^[A-Za-z0-9._/+@=,-]+$ ]] && reachable "$dir"; then
    echo "$dir"
  else
    echo "$short"
  fi
}

# Process ids: the master's, from base_dir (if it is still a live dovecot).
master_pid() {  # HOME
  local pid comm
  pid=$(head -n 1 "$1/run/master.pid" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  [ "$comm" = dovecot ] || return 1
  alive "$pid" || return 1
  echo "$pid"
}

# Alive and not a zombie (a container's pid 1 may never reap one).
alive() {
  local state
  state=$(awk '/^State:/ { print $2; exit }' "/proc/$1/status" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "$state" != Z ]
}

# All descendants of a process, from /proc (procps is not in every base
# image; pkill by name would hit other Dovecots).
descendants() {  # PID
  local -A kids=()
  local f p key val ppid queue=("$1") out=()
  for f in /proc/[0-9]*/status; do
    p=${f#/proc/}
    p=${p%/status}
    ppid=
    while read -r key val; do
      if [ "$key" = PPid: ]; then ppid=$val; break; fi
    done 2>/dev/null <"$f" || continue
    [ -n "$ppid" ] && kids[$ppid]+=" $p"
  done
  while ((${#queue[@]})); do
    p=${queue[0]}
    queue=("${queue[@]:1}")
    for f in ${kids[$p]:-}; do
      out+=("$f")
      queue+=("$f")
    done
  done
  echo "${out[*]:-}"
}

wait_gone() {  # SECONDS PID...
  local tries=$(($1 * 10)) p any
  shift
  for _ in $(seq 1 "$tries"); do
    any=0
    for p in "$@"; do alive "$p" && any=1; done
    [ "$any" -eq 1 ] || return 0
    sleep 0.1
  done
  return 1
}

kill_tree() {  # HOME
  local pid procs
  pid=$(master_pid "$1") || return 0
  # Stopped, the master cannot fork a child we would miss.
  kill -STOP "$pid" 2>/dev/null || true
  procs="$pid $(descendants "$pid")"
  # shellcheck disable=SC2086
  kill -KILL $procs 2>/dev/null || true
  # shellcheck disable=SC2086
  wait_gone 30 $procs || die "processes of the server in $1 still alive after SIGKILL: $procs"
}

stop_server() {  # HOME
  local pid procs
  pid=$(master_pid "$1") || return 0
  procs="$pid $(descendants "$pid")"
  kill -TERM "$pid" 2>/dev/null || true
  # shellcheck disable=SC2086
  wait_gone 30 $procs && return 0
  echo "imap.sh: the server in $1 did not stop within 30 s; killing it" >&2
  kill_tree "$1"
}

# A CA and a server certificate for 127.0.0.1 in HOME/tls (see the header).
make_certs() {  # HOME
  local t=$1/tls
  command -v openssl >/dev/null 2>&1 || die "--tls needs the openssl command (apt-get install openssl)"
  rm -rf "$t"
  mkdir -p "$t"
  cat >"$t/openssl.cnf" <<'EOF'
[req]
distinguished_name = dn
prompt = no
[dn]
CN = dibs test CA
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
EOF
  (
    umask 077
    openssl req -x509 -config "$t/openssl.cnf" -extensions ca -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
      -nodes -keyout "$t/ca.key" -out "$t/ca.crt" -days 3650 2>"$t/openssl.err"
    openssl req -new -config "$t/openssl.cnf" -subj "/CN=127.0.0.1" -newkey ec \
      -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$t/server.key" -out "$t/server.csr" 2>>"$t/openssl.err"
    openssl x509 -req -in "$t/server.csr" -CA "$t/ca.crt" -CAkey "$t/ca.key" \
      -set_serial "0x$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')" \
      -days 3650 -extfile "$t/openssl.cnf" -extensions server -out "$t/server.crt" 2>>"$t/openssl.err"
  ) || { cat "$t/openssl.err" >&2; die "could not make the test certificates in $t"; }
  chmod 0644 "$t/ca.crt" "$t/server.crt"
}

# The OAuth2 tokens' HS256 key (see the header), in the oauth2 passdb's
# key dict; test data, readable by the auth process.
make_oauth2_key() {  # HOME
  local k=$1/oauth2/keys/default/HS256
  command -v openssl >/dev/null 2>&1 || die "the OAuth2 key needs the openssl command (apt-get install openssl)"
  mkdir -p "$k"
  chmod 0755 "$1/oauth2" "$1/oauth2/keys" "$1/oauth2/keys/default" "$k"
  openssl rand -base64 32 | tr -d '\n' >"$k/default"
  chmod 0644 "$k/default"
}

write_config() {  # DIR HOME PORT [TLS_PORT]
  local dir=$1 home=$2 port=$3 tls_port=${4:-} user group uid gid login_user instance
  user=$(mail_user)
  uid=$(id -u "$user")
  gid=$(id -g "$user")
  group=$(id -gn "$user")
  if is_root && id -u dovenull >/dev/null 2>&1; then login_user=dovenull; else login_user=$user; fi
  instance=dibs-imap-$(printf '%s' "$dir" | sha256sum | cut -c1-8)
  umask 022
  mkdir -p "$home/state" "$home/mail"
  # Everything here is public test data: the auth process (the mail user)
  # reads the passwd-file.
  {
    echo "dibs:{PLAIN}dibs-secret:$uid:$gid::$home/mail/dibs::"
    echo "other:{PLAIN}other-secret:$uid:$gid::$home/mail/other::"
    echo "third:{PLAIN}third-secret:$uid:$gid::$home/mail/third::"
  } >"$home/users"
  # The users who may log in as another (PLAIN's authorization identity).
  echo "dibs:{PLAIN}dibs-secret" >"$home/masters"
  # After a master user's token (see the header), the user logged in as must
  # exist in a passdb for the token mechanisms: these, whose passwords no one
  # knows (the password is not checked again after a master login).
  for u in dibs other third; do
    printf '%s:{PLAIN}%s\n' "$u" "$(openssl rand -hex 24)"
  done >"$home/oauth2-users"
  # OAuth2: tokens are JWTs validated with the HS256 key in the dict
  # (fs:posix: the file <prefix><azp>/<alg>/<kid>, "default" for a missing
  # azp or kid; its content the key in base64), the user from "sub".
  cat >"$home/oauth2.conf" <<OAUTH2
introspection_mode = local
local_validation_key_dict = fs:posix:prefix=$home/oauth2/keys/
username_attribute = sub
OAUTH2
  # The master oauth2 passdb: only dibs's tokens.
  { cat "$home/oauth2.conf"; printf 'active_attribute = sub\nactive_value = dibs\n'; } >"$home/oauth2-master.conf"
  is_root && chown "$user:$group" "$home/mail"
  cat >"$dir/dovecot.conf.new" <<EOF
# Written by scripts/imap.sh: a throwaway IMAP server for dibs's tests,
# benchmarks and demo. Standalone: nothing of /etc/dovecot is read.
instance_name = $instance
base_dir = $home/run
state_dir = $home/state
log_path = "$dir/dovecot.log"
log_timestamp = "%Y-%m-%d %H:%M:%S "
auth_verbose = yes

protocols = imap
listen = 127.0.0.1
$(if [ -n "$tls_port" ]; then
    printf 'ssl = yes\nssl_cert = <%s\nssl_key = <%s\nssl_min_protocol = TLSv1.2\n' "$home/tls/server.crt" "$home/tls/server.key"
  else
    echo 'ssl = no'
  fi)
disable_plaintext_auth = no
auth_mechanisms = plain login xoauth2 oauthbearer
login_trusted_networks = 127.0.0.0/8
# A refused login is answered at once (at the auth process's next check,
# every 0.5 s), not after 2 s, nor later for an address that failed before
# (the penalty is off: its anvil socket cannot be opened, mode 0).
auth_failure_delay = 0

default_internal_user = $user
default_internal_group = $group
default_login_user = $login_user
first_valid_uid = $uid
last_valid_uid = 0
first_valid_gid = $gid
last_valid_gid = 0

# A master user's password, when a login asks for another's mailbox
# (PLAIN with an authorization identity), or a master user's token (the
# user name other*dibs: auth_master_user_separator); result_success =
# continue: that user must exist in the passdbs below.
auth_master_user_separator = *
passdb {
  driver = passwd-file
  master = yes
  mechanisms = plain login
  result_success = continue
  args = scheme=PLAIN username_format=%u $home/masters
}
passdb {
  driver = oauth2
  master = yes
  mechanisms = xoauth2 oauthbearer
  result_success = continue
  args = $home/oauth2-master.conf
}
passdb {
  driver = oauth2
  mechanisms = xoauth2 oauthbearer
  args = $home/oauth2.conf
}
passdb {
  driver = passwd-file
  mechanisms = xoauth2 oauthbearer
  args = scheme=PLAIN username_format=%u $home/oauth2-users
}
passdb {
  driver = passwd-file
  mechanisms = plain login
  args = scheme=PLAIN username_format=%u $home/users
}
userdb {
  driver = passwd-file
  args = username_format=%u $home/users
}

mail_location = sdbox:$home/mail/%u
# Every write is fsync'd before it is acknowledged, so that an APPEND or
# STORE the server has answered OK survives a power loss, not only a crash
# of the server: that is the guarantee dibs relies on, and what the
# benchmarks measure.
mail_fsync = always

# 40 concurrent clients (and more) from one user on one address.
default_process_limit = 1000
default_client_limit = 4000
protocol imap {
  mail_max_userip_connections = 1000
}
service imap {
  process_limit = 1000
}
service anvil {
  unix_listener anvil-auth-penalty {
    mode = 0
  }
}
# Login processes that stay (Dovecot's "high-performance mode"): each
# holds its connection to the auth process already, so the greeting and a
# LOGIN come at once. The default, one fresh process per connection, has to
# connect to auth first: until it has, it greets "Waiting for authentication
# process to respond.." and reads nothing, and a client that pipelines its
# commands and half-closes (nc -q) is dropped unanswered.
service imap-login {
  service_count = 0
  process_min_avail = 4
  process_limit = 64
  inet_listener imap {
    address = 127.0.0.1
    port = $port
  }
  inet_listener imaps {
    address = 127.0.0.1
    port = ${tls_port:-0}
  }
}
EOF
  if ! is_root; then
    # Unprivileged, the master can neither chroot nor switch users.
    cat >>"$dir/dovecot.conf.new" <<EOF

# Not root: no chroot for the services that have one by default.
service anvil {
  chroot =
}
service imap-login {
  chroot =
}
service imap-urlauth-login {
  chroot =
}
service ipc {
  chroot =
}
service old-stats {
  chroot =
}
EOF
  fi
  mv "$dir/dovecot.conf.new" "$dir/dovecot.conf"
}

# One IMAP conversation over bash's /dev/tcp: the greeting, a LOGIN whose
# OK must carry the capabilities dibs::imap needs, a LOGOUT.
probe() {  # PORT
  (
    { exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || exit 1
    IFS= read -r -t 5 line <&3 || exit 1
    [[ $line == "* OK"* ]] || exit 1
    printf 'a LOGIN dibs dibs-secret\r\n' >&3
    while IFS= read -r -t 5 line <&3; do
      case $line in
      "a OK"*)
        for cap in CONDSTORE QRESYNC UIDPLUS IDLE LITERAL+ MOVE ESEARCH SEARCHRES; do
          [[ " ${line%$'\r'} " == *" $cap "* ]] || { echo "imap.sh: no $cap in: $line" >&2; exit 2; }
        done
        printf 'b LOGOUT\r\n' >&3
        while IFS= read -r -t 5 line <&3 && [[ $line != "b "* ]]; do :; done
        exit 0
        ;;
      "a "*) echo "imap.sh: LOGIN failed: $line" >&2; exit 2 ;;
      esac
    done
    exit 1
  )
}

wait_ready() {  # DIR HOME PORT
  local rc
  for _ in $(seq 1 200); do
    rc=0
    probe "$3" || rc=$?
    [ "$rc" -eq 0 ] && return 0
    [ "$rc" -eq 2 ] && break
    master_pid "$2" >/dev/null || break
    sleep 0.1
  done
  echo "imap.sh: the server in $1 is not ready on port $3 (tail of $1/dovecot.log):" >&2
  tail -n 20 "$1/dovecot.log" >&2 2>/dev/null || true
  kill_tree "$2"
  exit 1
}

# Starts the master (it daemonizes; stdio on /dev/null so that a capturing
# parent such as ctest does not wait on it). 0: started; 2: port taken;
# 1: another failure (DIR/start.err, DIR/dovecot.log).
launch() {  # DIR HOME
  local rc=0
  # Dovecot refuses to start while the pid in master.pid exists, and a
  # killed master stays a zombie where pid 1 does not reap (a container
  # without an init): such a pid file is stale.
  master_pid "$2" >/dev/null || rm -f "$2/run/master.pid"
  "$dovecot_bin" -c "$1/dovecot.conf" </dev/null >/dev/null 2>"$1/start.err" || rc=$?
  [ "$rc" -eq 0 ] && return 0
  if grep -qs 'Address already in use' "$1/start.err"; then return 2; fi
  return 1
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

write_env() {  # DIR PORT (and DIR/tls_port, if started with --tls)
  printf 'DIBS_IMAP_HOST=127.0.0.1\nDIBS_IMAP_PORT=%s\nDIBS_IMAP_USER=dibs\nDIBS_IMAP_PASSWORD=dibs-secret\n' "$2" >"$1/env.new"
  printf 'DIBS_IMAP_OAUTH2_KEY=%s\n' "$(cat "$(cat "$1/home")/oauth2/keys/default/HS256/default")" >>"$1/env.new"
  if [ -f "$1/tls_port" ]; then
    printf 'DIBS_IMAP_TLS_PORT=%s\nDIBS_IMAP_CA_FILE=%s\n' "$(cat "$1/tls_port")" "$(cat "$1/home")/tls/ca.crt" >>"$1/env.new"
  fi
  mv "$1/env.new" "$1/env"
}

launch_failed() {  # DIR
  echo "imap.sh: dovecot did not start:" >&2
  cat "$1/start.err" >&2 2>/dev/null || true
  tail -n 20 "$1/dovecot.log" >&2 2>/dev/null || true
  exit 1
}

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then die "usage: imap.sh start DIR [--tls] | stop|kill|restart|env DIR"; fi
tls=0
case "${3:-}" in
"") ;;
--tls) [ "$cmd" = start ] || die "--tls goes with start (a restart keeps what start chose)"; tls=1 ;;
*) die "unknown option '$3' (imap.sh start DIR [--tls])" ;;
esac

case "$cmd" in
start)
  ensure_mail_user
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  # A server still running from an earlier start (an interrupted run).
  if [ -f "$dir/home" ]; then stop_server "$(cat "$dir/home")"; fi
  home=$(choose_home "$dir")
  echo "$home" >"$dir/home"
  mkdir -p "$home"
  chmod 0755 "$home"
  # A throwaway server starts empty.
  rm -rf "$home/mail" "$home/state" "$home/tls" "$home/oauth2" "$dir/env" "$dir/port" "$dir/tls_port"
  if [ "$tls" -eq 1 ]; then make_certs "$home"; fi
  make_oauth2_key "$home"
  for _ in $(seq 1 50); do
    port=$((20000 + RANDOM % 12000))  # below the ephemeral range (32768 up)
    port_free "$port" || continue
    tls_port=
    if [ "$tls" -eq 1 ]; then
      tls_port=$((20000 + RANDOM % 12000))  # below the ephemeral range (32768 up)
      if [ "$tls_port" -eq "$port" ] || ! port_free "$tls_port"; then continue; fi
    fi
    write_config "$dir" "$home" "$port" "$tls_port"
    rc=0
    launch "$dir" "$home" || rc=$?
    [ "$rc" -eq 2 ] && continue
    [ "$rc" -eq 0 ] || launch_failed "$dir"
    echo "$port" >"$dir/port"
    if [ -n "$tls_port" ]; then echo "$tls_port" >"$dir/tls_port"; fi
    wait_ready "$dir" "$home" "$port"
    write_env "$dir" "$port"
    cat "$dir/env"
    exit 0
  done
  die "no free port found for the server in $dir"
  ;;
stop)
  dir=$(cd "$dir" 2>/dev/null && pwd) || exit 0
  [ -f "$dir/home" ] || exit 0
  home=$(cat "$dir/home")
  stop_server "$home"
  # base_dir outside DIR: gone with the server (the mail stays until the
  # next start wipes it, so that a restart still finds it).
  [ "$home" = "$dir" ] || rm -rf "$home/run"
  ;;
kill)
  dir=$(cd "$dir" && pwd)
  [ -f "$dir/home" ] || die "no server was started in $dir"
  home=$(cat "$dir/home")
  master_pid "$home" >/dev/null || die "no server running in $dir"
  kill_tree "$home"
  ;;
restart)
  dir=$(cd "$dir" && pwd)
  for f in home port dovecot.conf; do [ -f "$dir/$f" ] || die "no server was started in $dir"; done
  home=$(cat "$dir/home")
  port=$(cat "$dir/port")
  ensure_mail_user
  stop_server "$home"
  # A killed server's dotlocks (dovecot.list.index.log.lock and the like,
  # and the .newlock of a transaction log it was rotating) are stale now
  # that none of its processes is left; Dovecot judges them by the pid
  # written in them, and once the machine has reused that pid the next
  # server waited 3 minutes for each (seen in CI for a .lock; for a
  # .newlock in a 20-run soak: "locked for 182 seconds (rotating while
  # syncing)"). Removed, as an administrator would after a crash.
  find "$home/mail" -type f \( -name '*.lock' -o -name '*.newlock' \) -delete 2>/dev/null || true
  mkdir -p "$home/state"
  # The killed server's port may linger a moment.
  for _ in $(seq 1 100); do
    rc=0
    launch "$dir" "$home" || rc=$?
    if [ "$rc" -eq 0 ]; then
      wait_ready "$dir" "$home" "$port"
      write_env "$dir" "$port"
      exit 0
    fi
    [ "$rc" -eq 2 ] || launch_failed "$dir"
    sleep 0.2
  done
  die "port $port is still taken: could not restart the server in $dir"
  ;;
env)
  [ -f "$dir/env" ] || die "no server was started in $dir"
  cat "$dir/env"
  ;;
*)
  die "unknown command '$cmd'"
  ;;
esac
