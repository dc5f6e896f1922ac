#!/usr/bin/env bash
# Random passwords for the compose demo, one file each, in deploy/compose/secrets/
# (ignored by git). Existing files are kept, so re-running changes nothing; delete a
# file and re-run (then `docker compose up etcd-roles`) to rotate that password.
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)/secrets"
mkdir -p "$dir"
chmod 700 "$dir"
umask 077
for name in root engine-default router-default; do
    if [ ! -s "$dir/$name" ]; then
        openssl rand -hex 24 >"$dir/$name"
        echo "make-secrets: created $dir/$name"
    fi
done
