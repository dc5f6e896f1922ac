"""Why an engine is or is not a candidate right now (``Router.explain``, ``Router.reasons``).

**Reasons.** ``explain(engine_id)`` says filter by filter why an engine is or is not a
candidate right now; ``reasons()`` counts the engines per reason (a metric). The filters
run on one engine in the order a pick applies them (``discovery._routing.pools``); a pinned
pick (``engine_id=``) whose engine is no candidate raises ``NotACandidateError`` with the
explanation.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from discovery._errors import NoEngineAvailableError, NotACandidateError
from discovery._records.record import EngineStatus
from discovery._routing.picker import NO_VERSIONS, by_version, versions_present
from discovery._routing.policies import Candidate
from discovery._routing.pools import Ask
from discovery._routing.view import TableView

__all__ = ["Explainer", "Explanation"]


@dataclass(frozen=True)
class Explanation:
    """Why an engine is or is not a candidate right now (``Router.explain``)."""

    engine_id: str
    candidate: bool
    """Whether a pick with these arguments may choose it."""
    reason: str
    """``candidate``, ``unconfirmed`` (a candidate kept after a mass lease loss), or the
    first filter that leaves it out: ``absent``, ``labels``, its status (``starting``,
    ``draining``, ``paused``, ``stalled``, ``stopping``, or ``status`` for one this
    version does not know), ``fit``, ``selector``, ``excluded``, ``version``, ``fenced``,
    ``capacity``."""
    checks: tuple[tuple[str, bool | None, str], ...]
    """Each filter in the order a pick applies them: (name, passed, what it saw); passed
    is None for a filter these arguments do not exercise or that an earlier one skipped."""

    def __str__(self) -> str:
        lines = [f"{self.engine_id}: {self.reason}"]
        for name, passed, detail in self.checks:
            mark = "-" if passed is None else ("ok" if passed else "NO")
            lines.append(f"  {mark:>2} {name}: {detail}")
        return "\n".join(lines)


class Explainer(TableView):
    """The router's explanations: a pick's filters run on one engine."""

    def explain(
        self,
        engine_id: str,
        prompt_tokens: Sequence[int] | None = None,
        max_tokens: int = 0,
        *,
        selector: Mapping[str, str] | None = None,
        weight_version: Literal["latest"] | None = None,
        min_weight_version: int | None = None,
        max_version_lag: int | None = None,
        exclude: Collection[str] | None = None,
        priority: int = 0,
    ) -> Explanation:
        """Why ``engine_id`` is or is not a candidate right now, filter by filter.

        With a request (``prompt_tokens`` and ``max_tokens``) the fit filter runs too;
        the other arguments are a pick's. Capacity is judged as the router's admission
        would (when admission is off it is shown but never excludes).
        """
        ask, _ = self._ask(
            prompt_tokens or (),
            max_tokens,
            selector=selector,
            weight_version=weight_version,
            min_weight_version=min_weight_version,
            max_version_lag=max_version_lag,
            block_hashes=None,
            exclude=exclude,
            wait=None,
            priority=priority,
        )
        with self._lock:
            self._refresh_locked()
            explanation = self._explain_locked(engine_id, ask, prompt_tokens is not None)
        self._deliver_notices()
        return explanation

    def reasons(self) -> dict[str, int]:
        """How many engines the router sees per reason (``Explanation.reason``), no request."""
        ask, _ = self._plain_ask((), 0)
        counts: dict[str, int] = {}
        with self._lock:
            self._refresh_locked()
            for engine_id in self._engines:
                reason = self._explain_locked(engine_id, ask, False).reason
                counts[reason] = counts.get(reason, 0) + 1
        self._deliver_notices()
        return counts

    def _explain_locked(self, engine_id: str, ask: Ask, with_request: bool) -> Explanation:
        """Run a pick's filters on one engine, in the pick's order (see ``explain``)."""
        checks: list[tuple[str, bool | None, str]] = []

        def verdict(candidate: bool, reason: str) -> Explanation:
            return Explanation(engine_id, candidate, reason, tuple(checks))

        engine = self._engines.get(engine_id)
        if engine is None:
            record = self._snapshot.get(engine_id) if self._snapshot is not None else None
            if record is None:
                checks.append(("table", False, "not in the routing table"))
                return verdict(False, "absent")
            checks.append(("table", True, "in the routing table"))
            unmet = self._selector.unmet(record.labels)
            checks.append(
                ("labels", False, f"fails '{unmet}' of the router's selector '{self._selector}'")
            )
            return verdict(False, "labels")
        ages = self._protection.ages()
        unconfirmed = ages.get(engine_id)
        checks.append(
            (
                "table",
                True,
                "in the routing table"
                if unconfirmed is None
                else f"unconfirmed: its record went {unconfirmed:.1f} s ago in a mass lease "
                "loss, kept routable until it comes back or the engine is seen dead",
            )
        )
        checks.append(
            (
                "labels",
                True,
                f"matches the router's selector '{self._selector}'"
                if self._selector
                else "the router has no selector",
            )
        )
        status = engine.record.status
        if status not in self._statuses:
            checks.append(
                ("status", False, f"{status}; candidates are {', '.join(sorted(self._statuses))}")
            )
            return verdict(False, status.value if isinstance(status, EngineStatus) else "status")
        checks.append(("status", True, str(status)))
        reason = self._explain_request_locked(engine, ask, with_request, checks)
        if reason is None:
            reason = self._explain_pool_locked(engine, ask, checks)
        if reason is not None:
            return verdict(False, reason)
        return verdict(True, "candidate" if unconfirmed is None else "unconfirmed")

    def _explain_request_locked(
        self,
        engine: Candidate,
        ask: Ask,
        with_request: bool,
        checks: list[tuple[str, bool | None, str]],
    ) -> str | None:
        """The filters of the request itself: fit, selector, exclude; the failing one."""
        need = len(ask.prompt_tokens) + ask.max_tokens
        if with_request:
            fits = engine.context_length >= need
            checks.append(("fit", fits, f"context_length {engine.context_length}, needs {need}"))
            if not fits:
                return "fit"
        else:
            checks.append(("fit", None, "no request given"))
        if ask.selector:
            unmet = ask.selector.unmet(engine.record.labels)
            checks.append(
                (
                    "selector",
                    unmet is None,
                    f"'{ask.selector}'" + ("" if unmet is None else f": its labels fail '{unmet}'"),
                )
            )
            if unmet is not None:
                return "selector"
        else:
            checks.append(("selector", None, "none given"))
        if engine.engine_id in ask.exclude:
            checks.append(("exclude", False, "excluded by the pick"))
            return "excluded"
        checks.append(("exclude", None if not ask.exclude else True, "not excluded"))
        return None

    def _explain_pool_locked(
        self, engine: Candidate, ask: Ask, checks: list[tuple[str, bool | None, str]]
    ) -> str | None:
        """The filters over the candidate set: version, fencing, capacity; the failing one."""
        need = len(ask.prompt_tokens) + ask.max_tokens
        engines = tuple(
            e
            for e in self._ordered[: self._fit_locked(need)]
            if ask.selector.matches(e.record.labels)
        )
        if ask.versions is not NO_VERSIONS:
            try:
                engines = by_version(engines, ask.versions)
            except NoEngineAvailableError:
                engines = ()
            kept = engine in engines
            checks.append(
                (
                    "version",
                    kept,
                    f"weight_version {engine.record.weight_version}; the candidates are on "
                    f"{versions_present(self._ordered)}",
                )
            )
            if not kept:
                return "version"
        else:
            checks.append(("version", None, "no version filter"))
        fence = self._fences.fenced.get(engine.engine_id)
        if fence is not None:
            applied = engine not in self._unfenced_locked(engines, ("explain",))
            left = fence - self._fences.now()
            note = "" if applied else " (ignored: too many candidates are fenced)"
            checks.append(("fencing", not applied, f"fenced for {left:.1f} s more{note}"))
            if applied:
                return "fenced"
        else:
            failures = self._fences.failures().get(engine.engine_id, 0)
            checks.append(("fencing", True, f"not fenced ({failures} failures in a row)"))
        detail = f"load {engine.load} of capacity {self._admission.limit(engine)}"
        if engine.routers > 1:
            detail += f", this router's share 1/{engine.routers} ({engine.in_flight} held)"
        if ask.admit:
            room = self._admission.has_room(engine, ask.priority)
            checks.append(("capacity", room, detail))
            if not room:
                return "capacity"
        else:
            checks.append(("capacity", None, f"{detail} (admission off)"))
        states = self._states
        if states is not None and engine.record.state_address:
            fresh = states.share(engine.engine_id) is not None
            checks.append(
                (
                    "state",
                    True,
                    "its relayed state is fresh"
                    if fresh
                    else "its relayed state is stale or unsynced: scored from this "
                    "router's own estimate",
                )
            )
        else:
            checks.append(("state", None, "no state relay"))
        return None

    def _not_a_candidate_locked(self, ask: Ask) -> NotACandidateError:
        assert ask.pin is not None
        explanation = self._explain_locked(ask.pin, ask, True)
        return NotACandidateError(
            f"engine {ask.pin} is no candidate ({explanation.reason}): "
            + "; ".join(
                f"{name}: {detail}" for name, ok, detail in explanation.checks if ok is False
            ),
            explanation,
        )
