"""The router's handles: ``PickHandle`` (one request's engine) and ``PickPair`` (a pair's).

A handle is held for the request's life and released once; while held it learns when its
engine stops being a good target (``lost``, ``on_lost``, ``wait_lost``). The router (its
``HandleOwner``) counts the losses and keeps the listeners; a handle asks it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Protocol

from discovery._records.record import EngineRecord, RecordView
from discovery._routing.policies import Candidate

__all__ = ["HandleOwner", "Listener", "PickHandle", "PickPair", "loss_of"]

Listener = Callable[["PickHandle"], object] | asyncio.Future[str]
_HELD = sys.maxsize  # a held handle's last loss to count: every one to come


class HandleOwner(Protocol):
    """What a handle asks of its router."""

    _losses: int
    """Engines that stopped being good targets, counted."""

    def _listen(self, handle: PickHandle, listener: Listener) -> bool: ...

    def _release(self, handle: PickHandle, failed: bool | None) -> None: ...


class PickHandle(RecordView):
    """The engine chosen for one request; hold it for the request's life, then release.

    A context manager: leaving the ``with`` block releases it (an exception leaving the
    block reports no outcome; call ``release(failed=True)`` for a failure). ``release()``
    is idempotent and never fails, also after the engine left the table. While held, it
    learns when its engine stops being a good target (``lost``, ``on_lost``,
    ``wait_lost``): cancel the request and pick again with ``exclude``.
    """

    __slots__ = (
        "_engine",
        "_released",
        "_router",
        "_since",
        "_until",
        "group",
        "matched_tokens",
        "policy",
        "record",
        "waited",
    )

    def __init__(
        self,
        router: HandleOwner,
        engine: Candidate,
        policy: str,
        matched_tokens: int,
        waited: float = 0.0,
    ) -> None:
        self._router = router
        self._engine = engine
        self._released = False
        self._since = router._losses  # losses of its engine after this one count...
        self._until = _HELD  # ...until it is released
        self.record: EngineRecord = engine.record
        """The chosen engine's record, as it was when picked."""
        self.policy = policy
        """The policy that chose the engine (a fallback shows as ``load_balanced``)."""
        self.matched_tokens = matched_tokens
        """For ``longest_prefix``: prompt tokens the engine was recently sent; else 0."""
        self.waited = waited
        """Seconds the pick waited for room (admission); 0 when it did not wait."""
        self.group: str | None = None
        """The group of the split the pick drew (its selector's text); None without one."""

    @property
    def released(self) -> bool:
        """Whether ``release()`` has run."""
        return self._released

    @property
    def lost(self) -> str | None:
        """Why the engine stopped being a good target while held (None: it has not)."""
        return loss_of(self)

    def on_lost(self, callback: Callable[[PickHandle], object]) -> None:
        """Call ``callback(handle)`` once if the engine stops being a good target while held.

        It runs on the table's event thread, never under a lock of the router; at once,
        on this thread, if that happened already. Never after ``release()``.
        """
        if not self._router._listen(self, callback):
            callback(self)

    async def wait_lost(self) -> str:
        """Wait (without blocking the loop) until the engine is lost; returns the reason.

        Never returns after the handle was released while held: cancel the wait then.
        """
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if not self._router._listen(self, future):
            return loss_of(self) or ""
        return await future

    def release(self, *, failed: bool = False) -> None:
        """Stop counting this request against its engine; ``failed`` reports a failure.

        Only the first call counts. ``failed=False`` (the default) is a success.
        """
        self._router._release(self, failed)

    def __enter__(self) -> PickHandle:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        # An exception in the block may be the caller's own: it says nothing of the engine.
        self._router._release(self, None if exc_type is not None else False)

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        reason = loss_of(self)
        lost = f" lost={reason!r}" if reason else ""
        return f"<PickHandle {self.engine_id} policy={self.policy} {state}{lost}>"


class PickPair:
    """The engines of one disaggregated request: ``prefill``, then ``decode``.

    ``prefill`` is None when one engine serves the whole request (``alone``: an aggregated
    engine, in ``decode``). Release each handle when its part is done (the prefill one once
    the hand-off is released), or the pair at once (``release``, or leaving ``with``).
    """

    __slots__ = ("decode", "prefill")

    def __init__(self, prefill: PickHandle | None, decode: PickHandle) -> None:
        self.prefill = prefill
        """The prefill engine's handle; None when one engine serves the request alone."""
        self.decode = decode
        """The decode engine's handle (or the one engine's, when alone)."""

    @property
    def alone(self) -> bool:
        """Whether one engine serves the whole request (no hand-off)."""
        return self.prefill is None

    def release(self, *, failed: bool = False) -> None:
        """Release both handles (each once; see ``PickHandle.release``)."""
        if self.prefill is not None:
            self.prefill.release(failed=failed)
        self.decode.release(failed=failed)

    def __enter__(self) -> PickPair:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        for handle in (self.prefill, self.decode):
            if handle is not None:
                handle.__exit__(exc_type)

    def __repr__(self) -> str:
        prefill = "alone" if self.prefill is None else self.prefill.engine_id
        return f"<PickPair {prefill} -> {self.decode.engine_id}>"


def loss_of(handle: PickHandle) -> str | None:
    """The first loss of ``handle``'s engine after it was picked (None: none yet)."""
    losses = handle._engine._losses
    if losses:
        for count, reason in losses:
            if handle._since < count <= handle._until:
                return reason
    return None
