#!/usr/bin/env bash
# A private CA and the certificates for etcd and discovery (openssl, ECDSA P-256).
#
# usage: deploy/certs/make-certs.sh [--renew | --add-ca | --switch-ca | --drop-old-ca] [OUT_DIR]
#
#   (no option)    create what is missing: CA, server certificate, client certificates.
#   --renew        issue every server/client certificate again with the current CA
#                  (leaf rotation; the CA and the trust bundle stay).
#   --add-ca       CA rotation, step 1: make the next CA and trust both (ca.pem gets it).
#   --switch-ca    step 2: the next CA becomes the current one; every leaf is issued again
#                  with it; ca.pem still trusts the previous CA.
#   --drop-old-ca  step 3: ca.pem trusts the current CA only.
#   Roll each step's files out everywhere before the next step (deploy/README.md).
#
# OUT_DIR (default deploy/certs/out, ignored by git) receives:
#   ca.pem                   trust bundle: give it to etcd and to every client
#   ca-cert.pem, ca-key.pem  the current CA (keep ca-key.pem offline; nothing runs with it)
#   server.pem, server-key.pem   etcd members: client port and peer port (serverAuth +
#                                clientAuth), SANs for every member name below
#   admin.pem, admin-key.pem     client certificate for etcdctl / deploy/etcd-roles.sh
#   engine.pem, engine-key.pem   client certificate for engines (discovery register)
#   router.pem, router-key.pem   client certificate for routers (discovery watch)
# Client certificates carry CNs that are not etcd user names (etcd-admin,
# discovery-engine, discovery-router): with --client-cert-auth etcd would take a
# certificate whose CN names a user as that user's login, so a certificate alone
# grants nothing here and every client still needs its password.
#
# Environment:
#   CERTS_MEMBERS        etcd member names (default "etcd-0 etcd-1 etcd-2", the compose
#                        service names and the StatefulSet pod names)
#   CERTS_K8S_NAMESPACE  Kubernetes namespace of the etcd StatefulSet: adds the names
#                        MEMBER.SERVICE[.NS[.svc[.DOMAIN]]] and CLIENT_SERVICE[...]
#   CERTS_K8S_SERVICE    headless service of the StatefulSet (default etcd)
#   CERTS_K8S_CLIENT_SERVICE  client service (default etcd-client)
#   CERTS_CLUSTER_DOMAIN cluster domain (default cluster.local)
#   CERTS_EXTRA_SANS     more SANs, comma-separated, e.g. DNS:etcd.example.com,IP:10.0.0.5
#   CERTS_DAYS           leaf lifetime in days (default 365); CERTS_CA_DAYS (default 3650)
set -euo pipefail

die() {
    echo "make-certs: $*" >&2
    exit 2
}
say() { echo "make-certs: $*"; }

mode=create
case "${1:-}" in
--renew | --add-ca | --switch-ca | --drop-old-ca)
    mode=${1#--}
    shift
    ;;
-h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
-*) die "unknown option $1 (see --help)" ;;
esac
[ $# -le 1 ] || die "usage: make-certs.sh [--renew|--add-ca|--switch-ca|--drop-old-ca] [OUT_DIR]"
out=${1:-"$(cd "$(dirname "$0")" && pwd)/out"}
command -v openssl >/dev/null || die "openssl is required"

members=${CERTS_MEMBERS:-etcd-0 etcd-1 etcd-2}
days=${CERTS_DAYS:-365}
ca_days=${CERTS_CA_DAYS:-3650}

mkdir -p "$out"
chmod 700 "$out"
cd "$out"
umask 077

new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# new_ca PREFIX: PREFIX-cert.pem and PREFIX-key.pem, a self-signed CA.
new_ca() {
    new_key "$1-key.pem"
    openssl req -x509 -new -key "$1-key.pem" -sha256 -days "$ca_days" \
        -subj "/CN=discovery-etcd-ca-$(date -u +%Y%m%d%H%M%S)-$RANDOM" \
        -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -out "$1-cert.pem"
    chmod 644 "$1-cert.pem"
}

server_sans() {
    local sans="DNS:localhost,IP:127.0.0.1,IP:::1" m ns=${CERTS_K8S_NAMESPACE:-}
    local svc=${CERTS_K8S_SERVICE:-etcd} client=${CERTS_K8S_CLIENT_SERVICE:-etcd-client}
    local domain=${CERTS_CLUSTER_DOMAIN:-cluster.local} name
    for m in $members; do
        sans+=",DNS:$m"
    done
    if [ -n "$ns" ]; then
        for name in $members; do
            name="$name.$svc"
            sans+=",DNS:$name,DNS:$name.$ns,DNS:$name.$ns.svc,DNS:$name.$ns.svc.$domain"
        done
        sans+=",DNS:$client,DNS:$client.$ns,DNS:$client.$ns.svc,DNS:$client.$ns.svc.$domain"
    fi
    [ -z "${CERTS_EXTRA_SANS:-}" ] || sans+=",$CERTS_EXTRA_SANS"
    printf '%s' "$sans"
}

# issue NAME CN USAGE [SANS]: NAME.pem and NAME-key.pem signed by the current CA.
issue() {
    local name=$1 cn=$2 usage=$3 sans=${4:-} ext
    ext=$(mktemp)
    {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=$usage"
        [ -z "$sans" ] || echo "subjectAltName=$sans"
    } >"$ext"
    new_key "$name-key.pem"
    openssl req -new -key "$name-key.pem" -subj "/CN=$cn" -out "$name.csr"
    openssl x509 -req -in "$name.csr" -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial \
        -sha256 -days "$days" -extfile "$ext" -out "$name.pem" 2>/dev/null
    rm -f "$name.csr" "$ext"
    chmod 644 "$name.pem"
    chmod 600 "$name-key.pem"
    say "issued $name.pem (CN=$cn)"
}

issue_all() {
    local force=$1
    issue_one() {
        if [ "$force" = 1 ] || [ ! -f "$1.pem" ] || [ ! -f "$1-key.pem" ]; then
            issue "$@"
        fi
    }
    issue_one server etcd serverAuth,clientAuth "$(server_sans)"
    issue_one admin etcd-admin clientAuth
    issue_one engine discovery-engine clientAuth
    issue_one router discovery-router clientAuth
}

# The trust bundle: the current CA, then the next or the previous one while rotating.
bundle() {
    cat ca-cert.pem >ca.pem.tmp
    [ ! -f ca-next-cert.pem ] || cat ca-next-cert.pem >>ca.pem.tmp
    [ ! -f ca-prev-cert.pem ] || cat ca-prev-cert.pem >>ca.pem.tmp
    chmod 644 ca.pem.tmp
    mv ca.pem.tmp ca.pem
}

case $mode in
create | renew)
    if [ ! -f ca-cert.pem ] || [ ! -f ca-key.pem ]; then
        [ "$mode" = create ] || die "no CA in $out: run without --renew first"
        new_ca ca
        say "created CA ca-cert.pem"
    fi
    issue_all "$([ "$mode" = renew ] && echo 1 || echo 0)"
    ;;
add-ca)
    [ -f ca-cert.pem ] || die "no CA in $out"
    [ ! -f ca-next-cert.pem ] || die "a next CA exists already: run --switch-ca"
    new_ca ca-next
    say "created the next CA ca-next-cert.pem; ca.pem trusts both"
    ;;
switch-ca)
    [ -f ca-next-cert.pem ] || die "no next CA: run --add-ca first (and roll ca.pem out)"
    mv ca-cert.pem ca-prev-cert.pem
    mv ca-key.pem ca-prev-key.pem
    mv ca-next-cert.pem ca-cert.pem
    mv ca-next-key.pem ca-key.pem
    rm -f ca-cert.srl
    issue_all 1
    say "switched to the next CA; ca.pem still trusts the previous one"
    ;;
drop-old-ca)
    rm -f ca-prev-cert.pem ca-prev-key.pem
    say "ca.pem trusts the current CA only"
    ;;
esac
bundle
say "done: $out"
