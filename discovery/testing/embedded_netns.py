"""Private etcd clusters that can be partitioned: one network namespace per member.

``PartitionableCluster(3)`` is an :class:`~discovery.testing.embedded.EtcdCluster` whose members
each run in a network namespace of their own (Linux, root, iproute2)::

    root namespace (clients)        member namespaces             hub namespace
    {p}r0 ═══ client link ═══ {p}s0 [{p}m0] {p}p0 ═══ peer link ═══ {p}q0 ─┐
    {p}r1 ═══ client link ═══ {p}s1 [{p}m1] {p}p1 ═══ peer link ═══ {p}q1 ─┼─ bridge {p}w
    {p}r2 ═══ client link ═══ {p}s2 [{p}m2] {p}p2 ═══ peer link ═══ {p}q2 ─┘  [{p}hub]

Clients in the root namespace reach member ``i`` over its own client link (a /30 in
100.64.0.0/10, chosen so parallel runs never share one); Raft traffic goes only over the
peer bridge (10.77.0.0/24, which exists only inside the namespaces). ``cut(member)`` drops
every packet on the member's peer link in both directions (``tc qdisc replace ... root
pfifo limit 0`` on both ends; netem is not needed), so the member is partitioned from the
others while clients still reach it; ``heal(member)`` removes the two qdiscs.

``add_host()`` adds a client host of its own, for a process that must lose etcd while the
others keep it (an engine host cut off from etcd)::

    {p}k ═══ {p}j [{p}h] {p}h0 ═══ {p}g0 [{p}m0]      (one such link per member)

Processes run in it with ``host.wrapper`` (``ip netns exec {p}h``); they reach member
``i`` at its usual client URL, routed over their own link ``{p}h{i}`` (10.78.i.0/30,
inside the namespaces only), and the root namespace reaches them at ``host.address`` (the
fourth /30 of the cluster's client block). ``host.cut()`` drops every packet on the host's
links to the members (``clients=True``: on its link to the root namespace too), both
ends; ``host.heal()`` removes those qdiscs.

Every namespace, link and bridge name starts with ``{p}`` = ``dsc{pid:x}x{n:x}``: unique
per process and cluster, and naming its owner; so does the members' data directory
(``$TMPDIR/{p}store``). Nothing is left behind:

* ``stop()`` kills the members by pid, then deletes the namespaces (which destroys their
  links and the bridge), any root-namespace link of the prefix and the data directory;
* a reaper process (its own session, so Ctrl-C and group kills miss it) does the same
  when its owner dies without ``stop()`` (SIGKILL): it waits for EOF on a pipe the owner
  holds;
* every start first sweeps names whose owner pid is dead (a reaper that was killed too).

``unavailable_reason()`` says why namespaces cannot be built here (not root, no ``ip`` or
``tc``, a kernel without veth or bridges), or returns None; tests skip with that reason.
Library code never imports this module.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from discovery.testing.embedded import EtcdCluster, EtcdMember

__all__ = ["EngineHost", "PartitionableCluster", "leftovers", "sweep_stale", "unavailable_reason"]

NAME_PREFIX = "dsc"
# {prefix} then a role letter outside [0-9a-f], so the prefix can be parsed back.
_NAME = re.compile(rf"^({NAME_PREFIX}([0-9a-f]+)x[0-9a-f]+)[g-z]")
_CLIENT_NET = (100 << 24) | (64 << 16)  # 100.64.0.0/10: 2**18 blocks of 16 addresses
_CLIENT_BLOCKS = 1 << 18
_PEER_NET = "10.77.0"
_HOST_NET = "10.78"  # {_HOST_NET}.{member}.0/30: the engine host's link to a member
_CLIENT_PORT = 2379
_PEER_PORT = 2380
_IFNAMSIZ = 15
_sequence = itertools.count()


class NetnsError(RuntimeError):
    """A namespace, link or qdisc command failed."""


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=30)
    if check and result.returncode != 0:
        raise NetnsError(f"{' '.join(command)}: {result.stderr.strip() or result.returncode}")
    return result


def _namespaces() -> list[str]:
    listing = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _root_links() -> list[str]:
    listing = _run("ip", "-o", "link", "show", check=False).stdout
    return [
        line.split(":")[1].strip().split("@")[0] for line in listing.splitlines() if ":" in line
    ]


def _data_dirs() -> list[str]:
    return [name for name in os.listdir(tempfile.gettempdir()) if name.startswith(NAME_PREFIX)]


def _data_dir(prefix: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"{prefix}store")


def leftovers(prefix: str = NAME_PREFIX) -> list[str]:
    """Namespaces, root-namespace links and data directories named ``prefix``..."""
    names = _namespaces() + _root_links() + _data_dirs()
    return [name for name in names if name.startswith(prefix)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_all(prefix: str) -> None:
    """Kill every process in the namespaces of ``prefix``; delete them, its links, its data."""
    for name in _namespaces():
        if not name.startswith(prefix):
            continue
        pids = [int(p) for p in _run("ip", "netns", "pids", name, check=False).stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.02)  # a killed process leaves its namespace only once reaped
        _run("ip", "netns", "delete", name, check=False)
    for link in _root_links():
        if link.startswith(prefix):
            _run("ip", "link", "delete", link, check=False)
    shutil.rmtree(_data_dir(prefix), ignore_errors=True)


def sweep_stale() -> list[str]:
    """Remove what earlier processes left behind (owner pid dead); the prefixes removed."""
    stale = set()
    for name in _namespaces() + _root_links() + _data_dirs():
        match = _NAME.match(name)
        if match and not _alive(int(match.group(2), 16)):
            stale.add(match.group(1))
    for prefix in sorted(stale):
        remove_all(prefix)
    return sorted(stale)


def _new_prefix() -> str:
    prefix = f"{NAME_PREFIX}{os.getpid():x}x{next(_sequence):x}"
    if len(prefix) + 3 > _IFNAMSIZ:  # the longest role suffix is "hub"
        raise NetnsError(f"name prefix {prefix!r} too long for interface names")
    return prefix


@functools.cache
def unavailable_reason() -> str | None:
    """Why partitionable clusters cannot be built on this machine, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run the tests as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (install iproute2)"
    prefix = _new_prefix()
    ns = f"{prefix}hub"
    try:
        sweep_stale()
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "add", f"{prefix}w", "type", "bridge")
        _run("ip", "-n", ns, "link", "add", f"{prefix}p0", "type", "veth", "peer", f"{prefix}q0")
        _run(
            "tc", "-n", ns, "qdisc", "replace", "dev", f"{prefix}p0", "root", "pfifo", "limit", "0"
        )
    except (NetnsError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot build network namespaces here: {exc}"
    finally:
        remove_all(prefix)
    return None


def _client_block() -> int:
    """A /28 of 100.64.0.0/10 that no address of the root namespace is in."""
    listing = _run("ip", "-o", "-4", "addr", "show").stdout
    used = set()
    for address in re.findall(r"inet (\d+)\.(\d+)\.(\d+)\.(\d+)", listing):
        value = int.from_bytes(bytes(int(part) for part in address), "big")
        if value >> 22 == _CLIENT_NET >> 22:
            used.add((value - _CLIENT_NET) >> 4)
    while (block := random.randrange(_CLIENT_BLOCKS)) in used:
        pass
    return block


def _ip(value: int) -> str:
    return ".".join(str(b) for b in value.to_bytes(4, "big"))


class _Network:
    """The namespaces and links of one cluster (see the module docs)."""

    def __init__(self, size: int) -> None:
        self.prefix = p = _new_prefix()
        self.hub = f"{p}hub"
        self.namespaces = [f"{p}m{i}" for i in range(size)]
        self.base = base = _CLIENT_NET + 16 * _client_block()
        self.client_hosts = [_ip(base + 4 * i + 2) for i in range(size)]
        self.peer_hosts = [f"{_PEER_NET}.{i + 1}" for i in range(size)]
        # Started before anything exists, so even a half-built network is removed.
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", __name__, "reap", p],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self._build(base)
        except BaseException:
            self.remove()
            raise

    def _build(self, base: int) -> None:
        p, hub = self.prefix, self.hub
        _run("ip", "netns", "add", hub)
        _run("ip", "-n", hub, "link", "add", f"{p}w", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", f"{p}w", "up")
        for i, ns in enumerate(self.namespaces):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # Peer link: member namespace <-> hub bridge.
            _run("ip", "-n", hub, "link", "add", f"{p}q{i}", "type", "veth",
                 "peer", f"{p}p{i}", "netns", ns)  # fmt: skip
            _run("ip", "-n", hub, "link", "set", f"{p}q{i}", "master", f"{p}w", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.peer_hosts[i]}/24", "dev", f"{p}p{i}")
            _run("ip", "-n", ns, "link", "set", f"{p}p{i}", "up")
            # Client link: root namespace <-> member namespace.
            _run("ip", "link", "add", f"{p}r{i}", "type", "veth", "peer", f"{p}s{i}", "netns", ns)
            _run("ip", "addr", "add", f"{_ip(base + 4 * i + 1)}/30", "dev", f"{p}r{i}")
            _run("ip", "link", "set", f"{p}r{i}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.client_hosts[i]}/30", "dev", f"{p}s{i}")
            _run("ip", "-n", ns, "link", "set", f"{p}s{i}", "up")

    def add_host(self) -> tuple[str, str]:
        """Build the engine host's namespace and links; its name and its root-side address."""
        p, ns = self.prefix, f"{self.prefix}h"
        if len(self.namespaces) > 3:
            raise NetnsError(
                "an engine host needs the client block's fourth /30: 3 members at most"
            )
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        for i, member_ns in enumerate(self.namespaces):
            host_end, member_end = f"{_HOST_NET}.{i}.1", f"{_HOST_NET}.{i}.2"
            _run("ip", "-n", ns, "link", "add", f"{p}h{i}", "type", "veth",
                 "peer", f"{p}g{i}", "netns", member_ns)  # fmt: skip
            _run("ip", "-n", ns, "addr", "add", f"{host_end}/30", "dev", f"{p}h{i}")
            _run("ip", "-n", ns, "link", "set", f"{p}h{i}", "up")
            _run("ip", "-n", member_ns, "addr", "add", f"{member_end}/30", "dev", f"{p}g{i}")
            _run("ip", "-n", member_ns, "link", "set", f"{p}g{i}", "up")
            # The member's usual client address, over this link (a member accepts a
            # connection to any of its addresses on any of its links).
            _run("ip", "-n", ns, "route", "add", f"{self.client_hosts[i]}/32", "via", member_end)
        root_end, host_end = _ip(self.base + 13), _ip(self.base + 14)
        _run("ip", "link", "add", f"{p}k", "type", "veth", "peer", f"{p}j", "netns", ns)
        _run("ip", "addr", "add", f"{root_end}/30", "dev", f"{p}k")
        _run("ip", "link", "set", f"{p}k", "up")
        _run("ip", "-n", ns, "addr", "add", f"{host_end}/30", "dev", f"{p}j")
        _run("ip", "-n", ns, "link", "set", f"{p}j", "up")
        return ns, host_end

    def host_ends(self, clients: bool) -> list[tuple[str, str]]:
        """Both ends of the engine host's links to the members (and to the root namespace)."""
        p, ns = self.prefix, f"{self.prefix}h"
        ends = []
        for i, member_ns in enumerate(self.namespaces):
            ends += [(ns, f"{p}h{i}"), (member_ns, f"{p}g{i}")]
        if clients:
            ends += [(ns, f"{p}j"), ("", f"{p}k")]
        return ends

    def drop(self, ends: Sequence[tuple[str, str]]) -> None:
        """Drop every packet on these (namespace, device) ends ("": the root namespace)."""
        for ns, dev in ends:
            where = ("-n", ns) if ns else ()
            _run("tc", *where, "qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "0")

    def undrop(self, ends: Sequence[tuple[str, str]]) -> None:
        for ns, dev in ends:
            where = ("-n", ns) if ns else ()
            _run("tc", *where, "qdisc", "del", "dev", dev, "root", check=False)

    def _peer_ends(self, index: int) -> list[tuple[str, str]]:
        return [
            (self.namespaces[index], f"{self.prefix}p{index}"),
            (self.hub, f"{self.prefix}q{index}"),
        ]

    def cut(self, index: int) -> None:
        self.drop(self._peer_ends(index))

    def heal(self, index: int) -> None:
        self.undrop(self._peer_ends(index))

    def is_cut(self, index: int) -> bool:
        ns, dev = self._peer_ends(index)[0]
        return "pfifo" in _run("tc", "-n", ns, "qdisc", "show", "dev", dev).stdout

    def remove(self) -> None:
        remove_all(self.prefix)
        if self._reaper.stdin is not None:
            self._reaper.stdin.close()  # EOF: the reaper checks once more and exits
        try:
            self._reaper.wait(15)
        except subprocess.TimeoutExpired:
            self._reaper.kill()
            self._reaper.wait()


class EngineHost:
    """A client host of a PartitionableCluster, in a namespace of its own (module docs)."""

    def __init__(self, network: _Network) -> None:
        self._network = network
        self.namespace, self.address = network.add_host()
        self.wrapper = ("ip", "netns", "exec", self.namespace)
        """The command prefix that runs a process on this host."""
        self._cut: list[tuple[str, str]] = []

    def cut(self, *, clients: bool = False) -> None:
        """Cut the host off from every member (``clients``: from the root namespace too)."""
        self._cut = self._network.host_ends(clients)
        self._network.drop(self._cut)

    def heal(self) -> None:
        """Undo ``cut()``. Idempotent."""
        cut, self._cut = self._cut, []
        self._network.undrop(cut)


class PartitionableCluster(EtcdCluster):
    """An EtcdCluster with one network namespace per member; ``cut`` / ``heal`` a member.

    Needs Linux and root: check :func:`unavailable_reason` first. The members listen on
    fixed ports inside their namespaces, so parallel clusters never compete for ports.
    """

    def __init__(self, size: int = 3, **kwargs: Any) -> None:
        super().__init__(size, **kwargs)
        self.network: _Network | None = None

    @property
    def prefix(self) -> str | None:
        """The name prefix of the current namespaces and links (None when stopped)."""
        return self.network.prefix if self.network is not None else None

    def _create_members(self) -> list[EtcdMember]:
        sweep_stale()
        self.network = net = _Network(self.size)
        # Named by the prefix, so the reaper and the sweep find it too.
        os.rename(self.base_dir, _data_dir(net.prefix))
        self.base_dir = _data_dir(net.prefix)
        return [
            EtcdMember(
                self,
                f"m{i}",
                _CLIENT_PORT,
                _PEER_PORT,
                client_host=net.client_hosts[i],
                peer_host=net.peer_hosts[i],
                wrapper=("ip", "netns", "exec", net.namespaces[i]),
            )
            for i in range(self.size)
        ]

    def _link(self, member: EtcdMember) -> tuple[_Network, int]:
        if self.network is None or member not in self.members:
            raise ValueError(f"{member.name} is not a member of this running cluster")
        return self.network, self.members.index(member)

    def cut(self, member: EtcdMember) -> None:
        """Drop all traffic between ``member`` and the other members (clients still reach it)."""
        network, index = self._link(member)
        network.cut(index)

    def heal(self, member: EtcdMember) -> None:
        """Undo ``cut(member)``. Idempotent."""
        network, index = self._link(member)
        network.heal(index)

    def add_host(self) -> EngineHost:
        """A client host in a namespace of its own that ``cut()`` can cut off from etcd.

        At most one per start; it goes with the cluster's namespaces at ``stop()``.
        """
        if self.network is None:
            raise ValueError("the cluster is not running")
        return EngineHost(self.network)

    def is_cut(self, member: EtcdMember) -> bool:
        """Whether ``member``'s peer link is cut now."""
        network, index = self._link(member)
        return network.is_cut(index)

    @contextlib.contextmanager
    def partitioned(self, member: EtcdMember) -> Iterator[EtcdMember]:
        """Cut ``member`` for the duration of the block; heal it even when the block fails."""
        self.cut(member)
        try:
            yield member
        finally:
            self.heal(member)

    def stop(self) -> None:
        """Kill every member, delete the data directory, the namespaces and the links."""
        try:
            super().stop()
        finally:
            network, self.network = self.network, None
            if network is not None:
                network.remove()


def _reap(argv: Sequence[str]) -> int:
    """``reap PREFIX``: wait until the owner closes our stdin (or dies), then clean up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.stdin.buffer.read()  # EOF once the owner closed the pipe or exited
    remove_all(argv[0])
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["reap"] or len(sys.argv) != 3:
        sys.exit("usage: python -m discovery.testing.embedded_netns reap PREFIX")
    sys.exit(_reap(sys.argv[2:]))
