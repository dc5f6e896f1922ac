# shellcheck shell=bash
# Sourced by .ci/run. `docker_engine_up` makes sure a Docker engine answers for the
# container tests:
#   * one answers already (DOCKER_HOST or the default socket): it is used as it is;
#   * else, as root: installs Debian's docker.io, docker-compose and debootstrap when
#     missing, starts a private dockerd (its own data root, exec root, pidfile and unix
#     socket under a temporary directory; no iptables rules; its containers' upstream
#     DNS is .ci/dns-nxdomain.py on its bridge) and exports DOCKER_HOST;
#     `docker_engine_down` (an EXIT trap of .ci/run) stops both by their pids and removes
#     its containers, networks, volumes, images and directories;
#   * where neither works it returns 1 after printing why (the Docker tests then skip,
#     and under CI=true that fails the run).

docker_engine_dir=""
docker_engine_pid=""
docker_engine_made_bridge=0
docker_engine_dns_pid=""
docker_engine_bridge=172.17.0.1  # docker0's address (Docker's default), pinned with --bip

_engine() { echo "docker-engine: $*"; }

docker_engine_up() {
    if docker version >/dev/null 2>&1; then
        _engine "using the engine at ${DOCKER_HOST:-the default socket}"
        return 0
    fi
    if [ "$(id -u)" != 0 ]; then
        _engine "no Docker engine answers and this is not root: cannot start one"
        return 1
    fi
    _engine_install || return 1
    if ip link show docker0 >/dev/null 2>&1; then
        _engine "a bridge docker0 exists already (another engine's): not starting a second"
        return 1
    fi
    docker_engine_dir=$(mktemp -d /tmp/ci-docker.XXXXXX)
    local dir=$docker_engine_dir
    # Its containers' upstream DNS is .ci/dns-nxdomain.py on the bridge's address, started
    # below (without NAT they reach no other; see that file for why it matters).
    dockerd --data-root "$dir/data" --exec-root "$dir/exec" --pidfile "$dir/dockerd.pid" \
        -H "unix://$dir/docker.sock" --iptables=false \
        --bip "$docker_engine_bridge/16" --dns "$docker_engine_bridge" >"$dir/dockerd.log" 2>&1 &
    docker_engine_pid=$!
    docker_engine_made_bridge=1
    export DOCKER_HOST="unix://$dir/docker.sock"
    local deadline=$((SECONDS + 60))
    until docker version >/dev/null 2>&1; do
        if ! kill -0 "$docker_engine_pid" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
            tail -n 20 "$dir/dockerd.log" >&2
            _engine "dockerd did not answer"
            docker_engine_down
            return 1
        fi
        sleep 0.5
    done
    python3 "$(dirname "${BASH_SOURCE[0]}")/dns-nxdomain.py" "$docker_engine_bridge" \
        >"$dir/dns.log" 2>&1 &
    docker_engine_dns_pid=$!
    _engine "dockerd $(docker version --format '{{.Server.Version}}') (pid $docker_engine_pid) at $DOCKER_HOST, DNS (pid $docker_engine_dns_pid) on $docker_engine_bridge"
}

# Debian's packages, where something is missing (about 20 s).
_engine_install() {
    local packages=()
    command -v dockerd >/dev/null || packages+=(docker.io)
    command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 ||
        packages+=(docker-compose)
    command -v debootstrap >/dev/null || packages+=(debootstrap)
    [ ${#packages[@]} -gt 0 ] || return 0
    if ! command -v apt-get >/dev/null; then
        _engine "no Docker engine and no apt-get to install ${packages[*]}"
        return 1
    fi
    _engine "installing ${packages[*]}"
    # policy-rc.d keeps the package from starting a system-wide dockerd.
    local log
    log=$(mktemp /tmp/ci-docker-apt.XXXXXX)
    if ! { apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${packages[@]}"; } >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        rm -f "$log"
        _engine "installing ${packages[*]} failed"
        return 1
    fi
    rm -f "$log"
    command -v dockerd >/dev/null || {
        _engine "docker.io installed no dockerd"
        return 1
    }
}

docker_engine_down() {
    local -
    set +e  # an EXIT trap: clean up all that can be, whatever fails
    [ -n "$docker_engine_pid" ] || return 0
    local dir=$docker_engine_dir pid=$docker_engine_pid
    docker_engine_pid=""
    # Everything in this engine is this run's: containers first (their networks and
    # volumes are then unused), then the daemon, then its directories.
    if docker version >/dev/null 2>&1; then
        docker ps -aq | xargs -r docker rm -f >/dev/null 2>&1
        docker network prune -f >/dev/null 2>&1
        docker volume prune -f >/dev/null 2>&1
    fi
    kill -TERM "$pid" 2>/dev/null
    if [ -n "$docker_engine_dns_pid" ]; then
        kill "$docker_engine_dns_pid" 2>/dev/null
        wait "$docker_engine_dns_pid" 2>/dev/null
        docker_engine_dns_pid=""
    fi
    local deadline=$((SECONDS + 30))
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then
        _engine "dockerd (pid $pid) did not stop: SIGKILL"
        kill -KILL "$pid" 2>/dev/null
        local containerd
        containerd=$(cat "$dir/exec/containerd/containerd.pid" 2>/dev/null || true)
        [ -z "$containerd" ] || kill -KILL "$containerd" 2>/dev/null
    fi
    wait "$pid" 2>/dev/null
    # Mounts left under its directories (overlays, network namespaces), deepest first.
    grep -o " $dir/[^ ]*" /proc/mounts | sort -r | xargs -r umount -l 2>/dev/null
    rm -rf --one-file-system "$dir"
    [ "$docker_engine_made_bridge" = 0 ] || ip link delete docker0 2>/dev/null
    unset DOCKER_HOST
    _engine "dockerd (pid $pid) stopped, $dir removed"
}
