#!/usr/bin/env bash
# Least-privilege etcd users and roles for discovery, one pair per namespace NS:
#
#   role discovery-engine-NS  readwrite on {root}/NS/engines/ (prefix)  -> user engine-NS
#   role discovery-router-NS  read      on {root}/NS/engines/ (prefix)  -> user router-NS
#   user root with role root (created if missing); then `auth enable`.
#
# Engines need readwrite, not just write: their registration transaction compares the
# key's version (a read), and etcd 3.5 lets LeaseRevoke / LeaseTimeToLive through only for
# a user with write permission on every key attached to the lease. Lease grant and
# keepalive need no key permission. Nothing else is granted: an engine cannot touch
# another namespace, a router cannot write, neither can change users or roles.
#
# Idempotent: re-running it converges on that state and changes only what differs
# (a role holding any other permission gets exactly the one above again; a user holding
# another role loses it; a password that differs is set). Every change of a password
# drops that user's auth tokens, so an unchanged run must change nothing.
#
# usage: deploy/etcd-roles.sh [NAMESPACE ...]   (default: $DISCOVERY_NAMESPACE or "default")
#
# Environment:
#   ETCDCTL_ENDPOINTS, ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_KEY, ETCDCTL_DIAL_TIMEOUT ...
#       etcdctl's own variables: where etcd is and the TLS files (ETCDCTL_CERT/KEY when
#       etcd runs with --client-cert-auth).
#   ROLES_ROOT_PASSWORD_FILE | ROLES_ROOT_PASSWORD
#       root's password: sets it when root is created, authenticates once auth is on.
#   ROLES_PASSWORD_DIR
#       directory with one file per user, named after it: engine-NS, router-NS.
#   ROLES_ENGINE_PASSWORD_FILE | ROLES_ENGINE_PASSWORD,
#   ROLES_ROUTER_PASSWORD_FILE | ROLES_ROUTER_PASSWORD
#       the two passwords when exactly one namespace is given (win over ROLES_PASSWORD_DIR).
#   DISCOVERY_ROOT      key root, as the package reads it (default /inference/v1).
#   ROLES_ENABLE_AUTH   1 (default): `auth enable` at the end; 0: leave auth as it is.
#   ROLES_ETCDCTL       the etcdctl binary (default: etcdctl on PATH).
#   ROLES_WAIT_SECONDS  0 (default): etcd must answer at once. N: first wait up to N seconds
#                       for every endpoint of ETCDCTL_ENDPOINTS to serve a quorum read (a
#                       cluster still forming, a member restarting), then fail naming them.
#
# Passwords are read from files or the environment and handed to etcdctl on stdin or in
# its environment, never on a command line (ps would show them). etcdctl reads a password
# from stdin as one word: passwords must not contain whitespace.
set -euo pipefail

die() {
    echo "etcd-roles: $*" >&2
    exit 2
}
say() { echo "etcd-roles: $*"; }

ETCDCTL=${ROLES_ETCDCTL:-etcdctl}
command -v "$ETCDCTL" >/dev/null 2>&1 || die "no etcdctl: put it on PATH or set ROLES_ETCDCTL"
export ETCDCTL_API=3
# Credentials are this script's business: never inherit someone else's.
unset ETCDCTL_USER ETCDCTL_PASSWORD

key_root=${DISCOVERY_ROOT:-/inference/v1}
name_re='^[A-Za-z0-9._-]{1,128}$'
[[ $key_root == /* && $key_root != */ ]] || die "DISCOVERY_ROOT $key_root must start with / and not end with /"
IFS=/ read -r -a segments <<<"${key_root#/}"
for segment in "${segments[@]}"; do
    [[ $segment =~ $name_re && $segment =~ [^.] ]] || die "DISCOVERY_ROOT $key_root: bad segment '$segment'"
done

if [ $# -eq 0 ]; then
    set -- "${DISCOVERY_NAMESPACE:-default}"
fi
for ns in "$@"; do
    [[ $ns =~ $name_re && $ns =~ [^.] ]] || die "namespace '$ns': use 1-128 letters, digits, '.', '_' or '-'"
done

# read_secret WHAT FILE_VAR VALUE_VAR [DIR_FILE]: the secret from the file named by the
# variable FILE_VAR, the variable VALUE_VAR or the file DIR_FILE, in that order (empty
# names are skipped); surrounding blanks and the trailing newline are dropped.
read_secret() {
    local what=$1 file_var=$2 value_var=$3 dir_file=${4:-} value
    if [ -n "$file_var" ] && [ -n "${!file_var:-}" ]; then
        [ -r "${!file_var}" ] || die "$file_var: cannot read ${!file_var}"
        value=$(<"${!file_var}")
    elif [ -n "$value_var" ] && [ -n "${!value_var:-}" ]; then
        value=${!value_var}
    elif [ -n "$dir_file" ] && [ -r "$dir_file" ]; then
        value=$(<"$dir_file")
    else
        local how=""
        [ -z "$file_var" ] || how="set $file_var or $value_var"
        [ -z "$dir_file" ] || how="${how:+$how, or }provide $dir_file"
        die "no password for $what: ${how:-set ROLES_PASSWORD_DIR}"
    fi
    value=${value#"${value%%[![:space:]]*}"}
    value=${value%"${value##*[![:space:]]}"}
    [ -n "$value" ] || die "the password for $what is empty"
    [[ $value != *[[:space:]]* ]] || die "the password for $what contains whitespace"
    printf '%s' "$value"
}

root_password=$(read_secret root ROLES_ROOT_PASSWORD_FILE ROLES_ROOT_PASSWORD)
# Every password is read before anything changes: a missing one changes nothing.
declare -A passwords
for ns in "$@"; do
    if [ $# -eq 1 ]; then
        dir=${ROLES_PASSWORD_DIR:+$ROLES_PASSWORD_DIR/}
        passwords[engine-$ns]=$(read_secret "engine-$ns" ROLES_ENGINE_PASSWORD_FILE \
            ROLES_ENGINE_PASSWORD "${dir:+${dir}engine-$ns}")
        passwords[router-$ns]=$(read_secret "router-$ns" ROLES_ROUTER_PASSWORD_FILE \
            ROLES_ROUTER_PASSWORD "${dir:+${dir}router-$ns}")
    else
        [ -n "${ROLES_PASSWORD_DIR:-}" ] || die "several namespaces: set ROLES_PASSWORD_DIR"
        for user in "engine-$ns" "router-$ns"; do
            passwords[$user]=$(read_secret "$user" "" "" "$ROLES_PASSWORD_DIR/$user")
        done
    fi
done

# Wait for etcd (ROLES_WAIT_SECONDS): every endpoint passes `endpoint health`, a quorum
# read. Denied counts as answered, since etcd checks permissions after the read's quorum
# round: an anonymous client ("user name is empty") or a certificate CN that names no user.
wait_seconds=${ROLES_WAIT_SECONDS:-0}
[[ $wait_seconds =~ ^[0-9]+$ ]] || die "ROLES_WAIT_SECONDS=$wait_seconds: give a whole number of seconds"
if [ "$wait_seconds" -gt 0 ]; then
    waited=$SECONDS
    while ! health=$("$ETCDCTL" endpoint health 2>&1); do
        if ! grep -q 'is unhealthy' <<<"$health"; then
            # etcdctl checked no endpoint (a flag or a file it cannot use): waiting won't help.
            grep -v '"level":"warn"' <<<"$health" >&2 || true
            die "etcdctl endpoint health failed"
        fi
        unanswered=$(grep 'is unhealthy' <<<"$health" | grep -v 'user name is empty' || true)
        [ -n "$unanswered" ] || break
        if [ $((SECONDS - waited)) -ge "$wait_seconds" ]; then
            printf '%s\n' "$unanswered" >&2
            die "etcd at ${ETCDCTL_ENDPOINTS:-127.0.0.1:2379} did not answer within $wait_seconds s"
        fi
        sleep 1
    done
    say "etcd answered after $((SECONDS - waited)) s"
fi

# ctl ARGS...: etcdctl as root once auth is on (anonymous before). Output: stdout only;
# etcdctl's retry warnings go to stderr and are kept for failures.
auth_on=0
ctl() {
    local err rc=0
    err=$(mktemp)
    if [ "$auth_on" = 1 ]; then
        ETCDCTL_USER=root ETCDCTL_PASSWORD=$root_password "$ETCDCTL" "$@" 2>"$err" || rc=$?
    else
        "$ETCDCTL" "$@" 2>"$err" || rc=$?
    fi
    if [ $rc -ne 0 ]; then
        grep -v '"level":"warn"' "$err" >&2 || true
    fi
    rm -f "$err"
    return $rc
}

# Is auth on? An anonymous `auth status` answers while it is off and is refused once on.
status_err=$(mktemp)
trap 'rm -f "$status_err"' EXIT
if status=$("$ETCDCTL" auth status 2>"$status_err"); then
    [[ $status == *"Status: true"* ]] && auth_on=1
elif grep -q 'user name is empty\|permission denied\|user name not found' "$status_err"; then
    auth_on=1
else
    grep -v '"level":"warn"' "$status_err" >&2 || true
    die "cannot reach etcd at ${ETCDCTL_ENDPOINTS:-127.0.0.1:2379}"
fi
if [ "$auth_on" = 1 ]; then
    ctl auth status >/dev/null || die "auth is on and root's password was refused"
    say "auth is on; working as root"
fi

# password_ok USER PASSWORD: whether etcd accepts that password (only knowable with auth on).
password_ok() {
    [ "$auth_on" = 1 ] || return 1
    # A user may read its own record: success means etcd took the password.
    ETCDCTL_USER=$1 ETCDCTL_PASSWORD=$2 "$ETCDCTL" user get "$1" >/dev/null 2>&1
}

# ensure_user USER PASSWORD: the user exists with that password.
ensure_user() {
    local user=$1 password=$2
    if ! ctl user get "$user" >/dev/null 2>&1; then
        printf '%s\n' "$password" | ctl user add "$user" --interactive=false >/dev/null
        say "created user $user"
    elif password_ok "$user" "$password"; then
        say "user $user: password unchanged"
    else
        printf '%s\n' "$password" | ctl user passwd "$user" --interactive=false >/dev/null
        say "user $user: password set"
    fi
}

# ensure_user_roles USER ROLE: ROLE is the user's only role.
ensure_user_roles() {
    local user=$1 want=$2 line have=() role found=0
    line=$(ctl user get "$user" | sed -n 's/^Roles://p')
    read -r -a have <<<"$line"
    for role in "${have[@]}"; do
        if [ "$role" = "$want" ]; then
            found=1
        else
            ctl user revoke-role "$user" "$role" >/dev/null
            say "user $user: revoked role $role"
        fi
    done
    if [ $found = 0 ]; then
        ctl user grant-role "$user" "$want" >/dev/null
        say "user $user: granted role $want"
    fi
}

# prefix_end PREFIX: etcd's range end for a prefix ending in '/' ('/' + 1 is '0').
prefix_end() { printf '%s0' "${1%/}"; }

# ensure_role ROLE read|readwrite PREFIX: the role holds exactly that one permission.
ensure_role() {
    local role=$1 type=$2 prefix=$3 end want have perms perm key range
    end=$(prefix_end "$prefix")
    local line
    line=$(printf '\t[%s, %s) (prefix %s)' "$prefix" "$end" "$prefix")
    if [ "$type" = readwrite ]; then
        want=$(printf 'Role %s\nKV Read:\n%s\nKV Write:\n%s' "$role" "$line" "$line")
    else
        want=$(printf 'Role %s\nKV Read:\n%s\nKV Write:' "$role" "$line")
    fi
    if ! have=$(ctl role get "$role" 2>/dev/null); then
        ctl role add "$role" >/dev/null
        say "created role $role"
        have=""
    fi
    if [ "$have" = "$want" ]; then
        say "role $role: unchanged ($type $prefix)"
        return
    fi
    # Revoke whatever it holds (from the JSON form: keys are base64, so any byte is safe).
    perms=$(ctl role get "$role" -w json | grep -o '{[^{}]*"key":[^{}]*}' || true)
    while IFS= read -r perm; do
        [ -n "$perm" ] || continue
        key=$(sed -n 's/.*"key":"\([^"]*\)".*/\1/p' <<<"$perm" | base64 -d)
        range=$(sed -n 's/.*"range_end":"\([^"]*\)".*/\1/p' <<<"$perm")
        if [ -z "$range" ]; then
            ctl role revoke-permission "$role" "$key" >/dev/null
        elif [ "$range" = "AA==" ]; then
            ctl role revoke-permission "$role" "$key" --from-key >/dev/null
        else
            ctl role revoke-permission "$role" "$key" "$(base64 -d <<<"$range")" >/dev/null
        fi
        say "role $role: revoked permission on $key"
    done <<<"$perms"
    ctl role grant-permission "$role" "$type" "$prefix" --prefix=true >/dev/null
    say "role $role: granted $type on $prefix"
}

# root first: `auth enable` refuses without it, and it must hold the root role.
if ! ctl user get root >/dev/null 2>&1; then
    [ "$auth_on" = 0 ] || die "auth is on but there is no root user"
    printf '%s\n' "$root_password" | ctl user add root --interactive=false >/dev/null
    say "created user root"
fi
ctl role get root >/dev/null 2>&1 || {
    ctl role add root >/dev/null
    say "created role root"
}
if ! ctl user get root | grep -q '^Roles:.*\broot\b'; then
    ctl user grant-role root root >/dev/null
    say "user root: granted role root"
fi

for ns in "$@"; do
    prefix="$key_root/$ns/engines/"
    ensure_role "discovery-engine-$ns" readwrite "$prefix"
    ensure_role "discovery-router-$ns" read "$prefix"
    ensure_user "engine-$ns" "${passwords[engine-$ns]}"
    ensure_user "router-$ns" "${passwords[router-$ns]}"
    ensure_user_roles "engine-$ns" "discovery-engine-$ns"
    ensure_user_roles "router-$ns" "discovery-router-$ns"
done

if [ "$auth_on" = 0 ] && [ "${ROLES_ENABLE_AUTH:-1}" = 1 ]; then
    ctl auth enable >/dev/null
    say "auth enabled"
fi
say "done: namespaces $* under $key_root"
