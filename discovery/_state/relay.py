"""The launcher's state relay: an engine's live state, served to routers over ZeroMQ.

etcd keeps membership and one pointer (the record's ``state_address``); the state itself
(which prefix blocks the engine caches, its load) changes far too often for etcd and is
relayed here, from the launcher that receives the engine's events, to every router that
asks. One ROUTER socket, msgpack frames (what Megatron uses), one port.

A router's ``EngineStates`` (``_state/engine_states.py``) connects a DEALER socket and sends:

* ``["sub"]``: subscribe; repeated every second as a heartbeat. A subscriber the relay
  does not know gets a snapshot first. One silent for ``subscriber_timeout`` is dropped.
* ``["snapshot"]``: send a snapshot now (after a gap, or a new epoch).
* ``["load", n]``: this router's ``n`` requests in flight on the engine (a heartbeat too).

The relay sends:

* ``["hello", epoch, seq, blocks, load]``: a snapshot. ``epoch`` is new at every launcher
  start; ``seq`` is the sequence number of the last increment the snapshot includes;
  ``blocks`` the cached block hashes, packed as little-endian uint64.
* ``["kv", epoch, seq, kind, blocks]``: one increment: ``stored`` / ``removed`` blocks,
  or ``cleared``; ``seq`` is one more than the previous increment's.
* ``["load", epoch, load]``: the load view, when it changed, at most ``1 / load_interval``
  times a second (10/s by default): ``{"in_flight": the sum of every live router's report,
  "routers": how many reported, "yours": the report of the router it is sent to (so it
  knows what the others hold), "counted": whether that router's report is in the sum,
  "rank": its place among the routers that report (0 first; by their identities, the same
  order for every router: admission gives the first ``capacity mod routers`` one slot
  more), "engine": what the engine reports or None}``. Reports of a router not heard from for
  ``subscriber_timeout`` age out. (No public Megatron version
  reports load on its event socket yet: ``engine`` is None until one does.)
* ``["tick", epoch, seq]`` every ``heartbeat`` s: a subscriber that missed the last
  increments sees ``seq`` ahead of its own and asks for a snapshot; one that hears
  nothing for a few ticks knows the relay is gone.
* ``["bye", epoch]`` when the relay closes (its launcher stops: the engine exited): the
  state is gone now. Routers keeping the engine routable without its record (after a
  mass lease loss) take it as the evidence that it is dead; it needs no etcd.

**Never blocks the receiver.** The engine-event receiver only applies an event to the
block set and queues the increment, under a lock also held (briefly: one copy of the
set) to take a snapshot. The relay's own thread sends: increments wait in a bounded
backlog (``backlog``) and, per subscriber, in ZeroMQ's bounded queue (``SNDHWM``); when a
subscriber cannot keep up, what does not fit is dropped and the subscriber, seeing the
sequence gap, resynchronises from a snapshot. Frames from subscribers over 1 KiB end their
connection (``MAXMSGSIZE``); anything else a subscriber sends that is not one of the three
requests is ignored and counted.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from discovery._errors import ConfigurationError
from discovery._state.kvstate import BlockSet, pack_hashes

if TYPE_CHECKING:
    import zmq

__all__ = ["RelayHealth", "StateRelay"]

log = logging.getLogger(__name__)

HEARTBEAT = 1.0
SUBSCRIBER_TIMEOUT = 5.0
LOAD_INTERVAL = 0.1
BACKLOG = 10_000  # increments waiting for the relay's thread
_SNDHWM = 1000  # messages queued per subscriber before ZeroMQ drops
_MAX_REQUEST = 1024
_BYE_LINGER_MS = 200  # how long closing waits for the goodbye to reach routers


@dataclass(frozen=True)
class RelayHealth:
    """A point-in-time view of a state relay."""

    address: str | None
    epoch: int
    seq: int
    """The sequence number of the last increment."""
    blocks: int
    """Block hashes the engine holds, as its events say."""
    subscribers: int
    in_flight: int
    """Requests in flight on the engine, summed over the routers that report."""
    dropped_blocks: int
    """Hashes dropped to keep the block set within the engine's capacity."""
    overflows: int
    """Increments dropped from a full backlog (subscribers resynchronise)."""
    garbage: int
    """Frames from subscribers that were no request."""


def bind_socket(sock: zmq.Socket[Any], address: str, what: str) -> str:
    """Bind ``sock`` at ``address`` (``tcp://HOST:PORT``, ``*`` for a random port).

    Returns the address bound; a busy port or a bad address is a ConfigurationError.
    """
    import zmq  # noqa: PLC0415

    try:
        if address.endswith(":*") or address.endswith(":0"):
            sock.bind_to_random_port(address.rsplit(":", 1)[0])
        else:
            sock.bind(address)
    except zmq.ZMQError as exc:
        reason = "the port is in use" if exc.errno == zmq.EADDRINUSE else str(exc)
        raise ConfigurationError(f"cannot bind the {what} on {address}: {reason}") from exc
    bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return bound


class StateRelay:
    """Serves one engine's block set and load to routers (see the module docs).

    ``publish`` is called by the thread that receives the engine's events; everything
    else runs on the relay's own thread, from ``start`` to ``close``.
    """

    def __init__(
        self,
        address: str,
        *,
        name: str,
        heartbeat: float = HEARTBEAT,
        subscriber_timeout: float = SUBSCRIBER_TIMEOUT,
        load_interval: float = LOAD_INTERVAL,
        backlog: int = BACKLOG,
    ) -> None:
        self._bind = address
        self._name = name
        self._heartbeat = heartbeat
        self._subscriber_timeout = subscriber_timeout
        self._load_interval = load_interval
        self.epoch = random.getrandbits(62) | 1  # new at every start; never 0
        """This relay's epoch: a subscriber that sees another one resynchronises."""
        self._lock = threading.Lock()
        self._blocks = BlockSet()
        self._seq = 0
        self._pending: collections.deque[tuple[int, str, bytes]] = collections.deque(maxlen=backlog)
        self._overflows = 0
        self._engine_load: dict[str, Any] | None = None
        self._address: str | None = None
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None
        self._stopping = False
        # Written by the relay's thread under the lock (health() reads them from others).
        self._subscribers: dict[bytes, float] = {}  # identity -> last heard
        self._reports: dict[bytes, int] = {}  # identity -> its in-flight report
        self._garbage = 0
        self._flushed = 0  # the sequence number of the last increment sent (or dropped)

    # -- the receiver's side ---------------------------------------------------------------

    def publish(self, kind: str, hashes: Iterable[int]) -> None:
        """Apply one checked KV event and queue it for the subscribers. Never blocks on I/O."""
        hashes = list(hashes)
        with self._lock:
            self._blocks.apply(kind, hashes)
            self._seq += 1
            if len(self._pending) == self._pending.maxlen:
                self._overflows += 1
            self._pending.append((self._seq, kind, pack_hashes(hashes)))
        self._poke()

    def resize(self, capacity: int) -> None:
        """Hold at most ``capacity`` block hashes (the engine's ``total_kv_blocks``)."""
        with self._lock:
            self._blocks.resize(capacity)

    def set_engine_load(self, load: Mapping[str, Any] | None) -> None:
        """What the engine itself reports about its load (relayed as ``engine``)."""
        with self._lock:
            self._engine_load = None if load is None else dict(load)
        self._poke()

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def hashes(self) -> list[int]:
        """The block hashes held now."""
        with self._lock:
            return self._blocks.hashes()

    def health(self) -> RelayHealth:
        """Epoch, sequence number, blocks, subscribers and counters."""
        with self._lock:
            return RelayHealth(
                address=self._address,
                epoch=self.epoch,
                seq=self._seq,
                blocks=len(self._blocks),
                subscribers=len(self._subscribers),
                in_flight=sum(self._reports.values()),
                dropped_blocks=self._blocks.dropped,
                overflows=self._overflows,
                garbage=self._garbage,
            )

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def address(self) -> str | None:
        """Where routers connect (``tcp://host:port``), once started."""
        return self._address

    def start(self) -> str:
        """Bind and start serving; returns the address bound."""
        import zmq  # noqa: PLC0415

        context = zmq.Context()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST)
        try:
            self._address = bind_socket(sock, self._bind, "state relay")
        except BaseException:
            sock.close()
            context.term()
            raise
        self._wake = os.pipe()
        os.set_blocking(self._wake[1], False)
        self._thread = threading.Thread(
            target=self._run, args=(context, sock), name="discovery-state-relay", daemon=True
        )
        self._thread.start()
        log.info("%s: relaying engine state on %s", self._name, self._address)
        return self._address

    def close(self) -> None:
        """Stop serving and join the relay's thread. Idempotent."""
        thread, wake = self._thread, self._wake
        if thread is not None and wake is not None:
            self._stopping = True
            self._poke()
            thread.join()
            self._thread = self._wake = None
            for fd in wake:
                os.close(fd)

    def _poke(self) -> None:
        wake = self._wake
        if wake is not None:
            with contextlib.suppress(BlockingIOError, OSError):  # full: a wakeup is pending
                os.write(wake[1], b"\0")

    # -- the relay's thread ------------------------------------------------------------------

    def _run(self, context: zmq.Context[Any], sock: zmq.Socket[Any]) -> None:
        import msgpack  # noqa: PLC0415
        import zmq  # noqa: PLC0415

        assert self._wake is not None
        wake = self._wake[0]
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        pack = msgpack.Packer(use_bin_type=True).pack
        next_tick = time.monotonic() + self._heartbeat
        load_sent: tuple[Any, ...] | None = None
        load_due = 0.0
        try:
            while True:
                now = time.monotonic()
                wait = max(0.0, min(next_tick, load_due if load_due > now else next_tick) - now)
                ready = dict(poller.poll(int(wait * 1000)))
                if self._stopping:
                    self._send_all(sock, pack(["bye", self.epoch]))
                    sock.setsockopt(zmq.LINGER, _BYE_LINGER_MS)  # the goodbye goes out first
                    return
                if wake in ready:
                    os.read(wake, 65536)
                if sock in ready:
                    self._serve(sock, pack, msgpack)
                self._flush(sock, pack)
                now = time.monotonic()
                with self._lock:
                    load = self._load()
                if load != load_sent and now >= load_due:
                    self._send_loads(sock, pack, dict(load))
                    load_sent, load_due = load, now + self._load_interval
                if now >= next_tick:
                    self._expire(now)
                    self._send_all(sock, pack(["tick", self.epoch, self._flushed]))
                    next_tick = now + self._heartbeat
        except Exception:
            log.exception(
                "%s: the state relay failed; routers fall back to their estimate", self._name
            )
        finally:
            sock.close()
            context.term()

    def _serve(self, sock: zmq.Socket[Any], pack: Any, msgpack: Any) -> None:
        """Answer every request waiting on the socket."""
        import zmq  # noqa: PLC0415

        while True:
            try:
                identity, frame = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not two frames
                with self._lock:
                    self._garbage += 1
                continue
            try:
                request = msgpack.unpackb(frame, raw=False)
                verb = request[0] if isinstance(request, list) and request else None
            except Exception:  # garbage from a subscriber: ignore it, count it
                verb = None
            with self._lock:
                if verb not in ("sub", "snapshot", "load"):
                    self._garbage += 1
                    continue
                known = identity in self._subscribers
                self._subscribers[identity] = time.monotonic()
                if verb == "load" and len(request) == 2 and type(request[1]) is int:
                    self._reports[identity] = max(0, request[1])
            if verb == "snapshot" or not known:
                self._flush(sock, pack)  # increments up to the snapshot's seq go first
                sock.send_multipart([identity, self._snapshot(pack, identity)], zmq.NOBLOCK)

    def _snapshot(self, pack: Any, identity: bytes) -> bytes:
        with self._lock:
            seq, hashes, load = self._seq, self._blocks.hashes(), dict(self._load())
            load.update(self._yours(identity))
        return bytes(pack(["hello", self.epoch, seq, pack_hashes(hashes), load]))

    def _yours(self, identity: bytes) -> dict[str, Any]:
        """What the load view tells one router of itself (under the lock)."""
        counted = identity in self._reports
        rank = sorted(self._reports).index(identity) if counted else len(self._reports)
        return {"yours": self._reports.get(identity, 0), "counted": counted, "rank": rank}

    def _send_loads(self, sock: zmq.Socket[Any], pack: Any, load: dict[str, Any]) -> None:
        """The load view to each subscriber, with its own report in it."""
        import zmq  # noqa: PLC0415

        with self._lock:
            yours = {identity: self._yours(identity) for identity in self._subscribers}
        for identity, own in yours.items():
            view = {**load, **own}
            sock.send_multipart([identity, pack(["load", self.epoch, view])], zmq.NOBLOCK)

    def _load(self) -> tuple[tuple[str, Any], ...]:
        """The load view (under the lock)."""
        engine = self._engine_load
        return (
            ("in_flight", sum(self._reports.values())),
            ("routers", len(self._reports)),
            ("engine", engine),
        )

    def _flush(self, sock: zmq.Socket[Any], pack: Any) -> None:
        """Send every queued increment to every subscriber."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                seq, kind, hashes = self._pending.popleft()
            self._flushed = seq
            self._send_all(sock, pack(["kv", self.epoch, seq, kind, hashes]))

    def _send_all(self, sock: zmq.Socket[Any], frame: bytes) -> None:
        import zmq  # noqa: PLC0415

        for identity in list(self._subscribers):  # only this thread changes the set
            # A full per-subscriber queue drops the message (ROUTER never blocks here).
            sock.send_multipart([identity, frame], zmq.NOBLOCK)

    def _expire(self, now: float) -> None:
        with self._lock:
            for identity, heard in list(self._subscribers.items()):
                if now - heard > self._subscriber_timeout:
                    del self._subscribers[identity]
                    self._reports.pop(identity, None)
