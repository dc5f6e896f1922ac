# shellcheck shell=bash
# Sourced by .ci/run. `prometheus_tools_up` makes sure Debian's prometheus package is
# there for the Prometheus tests (tests/test_alerts.py: `promtool test rules`, and a real
# Prometheus server that the tests start and stop themselves):
#   * `prometheus` and `promtool` on PATH already: nothing to do;
#   * else, as root with apt-get: `apt-get install prometheus` (no service is started: a
#     policy-rc.d refuses service starts during the install, and is removed after);
#   * where neither works it returns 1 after printing why (the Prometheus tests then skip,
#     and under CI=true that fails the run).

_prom() { echo "prometheus-tools: $*"; }

prometheus_tools_up() {
    if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
        _prom "using $(command -v prometheus) and $(command -v promtool)"
        return 0
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        _prom "no prometheus/promtool, and no root apt-get to install Debian's prometheus"
        return 1
    fi
    _prom "installing Debian's prometheus"
    local log made_policy=0 status=0
    log=$(mktemp /tmp/ci-prometheus-apt.XXXXXX)
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    { apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            prometheus; } >"$log" 2>&1 || status=$?
    [ "$made_policy" = 0 ] || rm -f /usr/sbin/policy-rc.d
    if [ "$status" != 0 ] || ! command -v promtool >/dev/null; then
        tail -n 20 "$log" >&2
        rm -f "$log"
        _prom "installing prometheus failed"
        return 1
    fi
    rm -f "$log"
    _prom "$(prometheus --version 2>&1 | head -n 1)"
}
