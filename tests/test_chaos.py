"""Chaos soak: registrars and watchers against a 3-member etcd cluster under random faults.

20 ``discovery register`` and 3 ``discovery watch --format jsonl`` subprocesses run while
the test, at random, SIGKILLs or SIGTERMs registrars and starts new ones, kills and restarts
etcd members (the leader included), cuts a member (the leader included) off from the other
two for 0.3 s to 2 TTLs (a network partition: the members run in network namespaces; where
those cannot be built the soak runs without partitions and warns why), forces compaction,
and once (every ~90 s in the long variant) stops the whole cluster for longer than the TTL.
Then, once every registrar has settled and the TTLs of the killed ones have passed:

* etcd holds exactly the keys of the live registrars (none left without a live owner);
* each watcher's table, rebuilt from its event stream, equals etcd's content;
* each event stream is in revision order, without duplicates, and consistent (``added``
  only for an absent engine, ``updated`` / ``removed`` only for a present one);
* no watcher is stale: each one's last staleness report (if any) says it is current again;
* no watcher or registrar crashed: the live ones still run and exit 0 on SIGTERM, the
  ones SIGTERMed during the run exited 0, and no log holds a traceback.

The CI variant injects faults for 45 s (about 55 s in all on 2 cores). Set
``DISCOVERY_CHAOS_SECONDS`` (e.g. 600) for a long soak. The counts of each fault are printed;
``DISCOVERY_CHAOS_SEED`` replays a run's random choices (the seed is printed).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from discovery import Connection, Settings
from discovery.testing.embedded import EtcdCluster, EtcdMember
from discovery.testing.embedded_netns import PartitionableCluster

from .helpers import Registrar, cli_env, raw_call, wait_for

CHAOS_SECONDS = float(os.environ.get("DISCOVERY_CHAOS_SECONDS") or 45)
TTL = 3
REGISTRARS = 20
WATCHERS = 3
CLUSTER_STOP_EVERY = 90.0  # seconds of chaos per whole-cluster stop (at least one)
# A SIGKILLed registrar's key lives until its TTL, plus an election timeout after a
# leader change (a new leader renews every lease), plus etcd's 0.5 s expiry sweep.
SETTLE = TTL + 1 + 0.5 + 20
WATCH_FLAGS = ("--format", "jsonl", "--dial-timeout", "30")

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(CHAOS_SECONDS + 240)]


class Watcher:
    """A ``discovery watch --format jsonl`` subprocess writing events to a file."""

    def __init__(self, settings: Settings, directory: Path, index: int) -> None:
        self.events_path = directory / f"watcher-{index}.jsonl"
        self.log_path = directory / f"watcher-{index}.log"
        with open(self.events_path, "wb") as out, open(self.log_path, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "discovery", "watch", *WATCH_FLAGS],
                env=cli_env(settings),
                stdout=out,
                stderr=err,
            )

    def events(self) -> list[dict]:
        """Every complete line written so far."""
        data = self.events_path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def replay(events: list[dict]) -> tuple[dict[str, dict], list[str]]:
    """Rebuild a watcher's table from its events; list every ordering/consistency problem."""
    table: dict[str, dict] = {}
    problems: list[str] = []
    seen: set[tuple[str, int, str]] = set()
    last = 0
    for n, event in enumerate(events):
        kind, engine, revision = event["type"], event["engine_id"], event["revision"]
        where = f"event {n} ({kind} {engine} rev {revision})"
        if revision < last:
            problems.append(f"{where}: revision goes back from {last}")
        last = max(last, revision)
        ident = (event["key"], revision, kind)
        if ident in seen:
            problems.append(f"{where}: duplicate")
        seen.add(ident)
        if kind == "added":
            if engine in table:
                problems.append(f"{where}: added while present")
            table[engine] = event
        elif kind == "updated":
            if engine not in table:
                problems.append(f"{where}: updated while absent")
            table[engine] = event
        elif kind == "removed":
            if engine not in table:
                problems.append(f"{where}: removed while absent")
            table.pop(engine, None)
        else:
            problems.append(f"{where}: unknown type")
    return table, problems


class Chaos:
    """The fault schedule and the bookkeeping of who is alive."""

    def __init__(self, cluster: EtcdCluster, settings: Settings) -> None:
        self.cluster = cluster
        self.settings = settings
        self.conn = Connection(settings)
        self.seed = int(os.environ.get("DISCOVERY_CHAOS_SEED") or time.time_ns() % 10**9)
        print(f"chaos seed {self.seed} (DISCOVERY_CHAOS_SEED replays the schedule)")
        self.rng = random.Random(self.seed)
        self.faults: collections.Counter[str] = collections.Counter()
        self.live: list[Registrar] = []
        self.sigkilled: list[Registrar] = []
        self.sigtermed: list[Registrar] = []
        self.next_id = 0
        self.down: dict[EtcdMember, float] = {}  # member -> when to start it again
        self.cut: dict[EtcdMember, float] = {}  # member -> when to heal its peer link
        self.pause = threading.Event()  # never set: its wait() paces the faults

    # -- registrars --------------------------------------------------------------------

    def start_registrar(self) -> None:
        engine_id = f"chaos-{self.next_id:03d}"
        self.next_id += 1
        # --dial-timeout: a registrar started while etcd is unreachable keeps trying.
        self.live.append(
            Registrar(self.settings, engine_id, ttl=TTL, extra=("--dial-timeout", "30"))
        )

    @staticmethod
    def ready(registrar: Registrar) -> bool:
        return f"registered {registrar.engine_id} at" in registrar.output()

    def signal_registrar(self, sig: signal.Signals) -> None:
        candidates = [r for r in self.live if self.ready(r)]
        if not candidates:
            return
        victim = self.rng.choice(candidates)
        self.live.remove(victim)
        victim.signal(sig)
        if sig is signal.SIGKILL:
            self.sigkilled.append(victim)
            self.faults["registrar SIGKILL"] += 1
        else:
            self.sigtermed.append(victim)
            self.faults["registrar SIGTERM"] += 1

    # -- etcd --------------------------------------------------------------------------

    def repair_due_members(self, *, all_now: bool = False) -> None:
        now = time.monotonic()
        for member, due in list(self.down.items()):
            if all_now or now >= due:
                member.start()
                del self.down[member]
        for member, due in list(self.cut.items()):
            if all_now or now >= due:
                assert isinstance(self.cluster, PartitionableCluster)
                self.cluster.heal(member)
                del self.cut[member]

    def all_healthy(self) -> bool:
        return (
            not self.down
            and not self.cut
            and all(m.running and m.healthy() for m in self.cluster.members)
        )

    def pick_member(self, *, leader: bool) -> EtcdMember | None:
        """The leader or a random follower, when every member is healthy (quorum stays)."""
        if not self.all_healthy():
            return None  # one member impaired at a time
        try:
            target = self.cluster.leader()
        except Exception:
            return None  # electing right now
        if not leader:
            target = self.rng.choice([m for m in self.cluster.members if m is not target])
        return target

    def kill_member(self, *, leader: bool) -> None:
        if (target := self.pick_member(leader=leader)) is None:
            return
        target.stop(kill=True)
        self.down[target] = time.monotonic() + self.rng.uniform(0.5, 3.0)
        self.faults["etcd leader SIGKILL" if leader else "etcd follower SIGKILL"] += 1

    def partition_member(self, *, leader: bool) -> None:
        if not isinstance(self.cluster, PartitionableCluster):
            return
        if (target := self.pick_member(leader=leader)) is None:
            return
        self.cluster.cut(target)
        # From shorter than an election timeout (nothing should happen) to 2 TTLs.
        length = self.rng.uniform(0.3, 2 * TTL)
        self.cut[target] = time.monotonic() + length
        role = "leader" if leader else "follower"
        self.faults[f"etcd {role} partitioned {'< 1 s' if length < 1 else '>= 1 s'}"] += 1

    def compact(self) -> None:
        try:
            revision, _ = self.conn.list_prefix(self.settings.keyspace.prefix, timeout=5)
            raw_call(self.conn, lambda c: c.compact(revision), timeout=5)
        except Exception:
            self.faults["compaction attempt failed (etcd busy)"] += 1
            return
        self.faults["compaction"] += 1

    def stop_cluster(self) -> None:
        self.repair_due_members(all_now=True)
        self.cluster.wait_healthy(timeout=30)
        for member in self.cluster.members:
            member.stop(kill=True)
        self.faults["whole cluster stopped > TTL"] += 1
        self.pause.wait(TTL + 1.5)
        for member in self.cluster.members:
            member.start()
        self.cluster.wait_healthy(timeout=30)
        # Registrars write their records again now; compact while the watchers are still
        # in their reconnect backoff, so they resume below the compaction and list again.
        self.pause.wait(self.rng.uniform(0.3, 1.0))
        self.compact()

    # -- the run -------------------------------------------------------------------------

    def run(self, seconds: float) -> None:
        start = time.monotonic()
        stops = max(1, round(seconds / CLUSTER_STOP_EVERY))
        # Whole-cluster stops: one in each equal slice of the run, at a random point of it.
        stop_at = [
            start + seconds * (k + self.rng.uniform(0.25, 0.75)) / stops for k in range(stops)
        ]
        actions = {
            "sigkill": 3.0,
            "sigterm": 3.0,
            "start": 2.0,
            "follower": 1.5,
            "leader": 1.5,
            "cut follower": 1.5,
            "cut leader": 1.5,
            "compact": 1.5,
        }
        while time.monotonic() - start < seconds:
            self.repair_due_members()
            if stop_at and time.monotonic() >= stop_at[0]:
                stop_at.pop(0)
                self.stop_cluster()
                continue
            action = self.rng.choices(list(actions), weights=list(actions.values()))[0]
            if action == "sigkill":
                self.signal_registrar(signal.SIGKILL)
            elif action == "sigterm":
                self.signal_registrar(signal.SIGTERM)
            elif action == "start" and len(self.live) < REGISTRARS + 2:
                self.start_registrar()
                self.faults["registrar started"] += 1
            elif action in ("follower", "leader"):
                self.kill_member(leader=action == "leader")
            elif action in ("cut follower", "cut leader"):
                self.partition_member(leader=action == "cut leader")
            elif action == "compact":
                self.compact()
            while len(self.live) < REGISTRARS - 2:  # replace the fallen
                self.start_registrar()
                self.faults["registrar started"] += 1
            self.pause.wait(self.rng.uniform(0.3, 1.5))
        while stop_at:  # a short run still stops the whole cluster once
            stop_at.pop(0)
            self.stop_cluster()
        # End on a SIGKILL, so the settling below always waits out a TTL.
        self.signal_registrar(signal.SIGKILL)

    def etcd_content(self) -> dict[str, dict]:
        _, kvs = self.conn.list_prefix(self.settings.keyspace.prefix, timeout=10)
        content = {}
        for kv in kvs:
            record = self.settings.keyspace.decode(kv.key, kv.value)
            content[record.engine_id] = {
                "endpoint": record.endpoint.to_dict(),
                "labels": dict(record.labels),
            }
        return content


def table_view(table: dict[str, dict]) -> dict[str, dict]:
    return {e: {"endpoint": ev["endpoint"], "labels": ev["labels"]} for e, ev in table.items()}


def last_staleness_report(log: str) -> str | None:
    """The watcher's last 'is stale' / 'is current again' log line, if any."""
    reports = [line for line in log.splitlines() if "is stale" in line or "current again" in line]
    return reports[-1] if reports else None


def test_chaos_soak(chaos_etcd3: EtcdCluster, tmp_path: Path, capsys) -> None:
    etcd3 = chaos_etcd3
    settings = Settings(
        endpoints=etcd3.endpoints, namespace=f"chaos-{os.getpid()}", dial_timeout=20
    )
    chaos = Chaos(etcd3, settings)
    watchers: list[Watcher] = []
    began = time.monotonic()
    try:
        watchers = [Watcher(settings, tmp_path, i) for i in range(WATCHERS)]
        for _ in range(REGISTRARS):
            chaos.start_registrar()
        wait_for(
            lambda: (
                all(chaos.ready(r) for r in chaos.live)
                and all(len(replay(w.events())[0]) == REGISTRARS for w in watchers)
            ),
            timeout=60,
            message="every registrar registered and seen by every watcher",
            interval=0.2,
        )
        setup = time.monotonic() - began

        chaos.run(CHAOS_SECONDS)

        # Settle: every member back, every live registrar registered, TTLs passed.
        settle_began = time.monotonic()
        chaos.repair_due_members(all_now=True)
        etcd3.wait_healthy(timeout=30)
        try:
            wait_for(
                lambda: all(chaos.ready(r) for r in chaos.live),
                timeout=60,
                message="every live registrar registered",
                interval=0.2,
            )
        except AssertionError as exc:
            unready = [r for r in chaos.live if not chaos.ready(r)]
            raise AssertionError(
                f"{exc}; not registered: "
                + "\n".join(
                    f"{r.engine_id} (exit status {r.process.poll()}):\n{r.output()[-2000:]}"
                    for r in unready
                )
            ) from None
        live_ids = {r.engine_id for r in chaos.live}
        wait_for(
            lambda: set(chaos.etcd_content()) == live_ids,
            timeout=SETTLE,
            message="etcd to hold exactly the live registrars' keys",
            interval=0.2,
        )
        content = chaos.etcd_content()
        for registrar in chaos.live:
            address = content[registrar.engine_id]["endpoint"]["coordinator_address"]
            assert address == f"tcp://{registrar.engine_id}:5555"

        def watchers_agree() -> bool:
            return all(table_view(replay(w.events())[0]) == content for w in watchers)

        try:
            wait_for(watchers_agree, timeout=30, message="every watcher's table == etcd")
        except AssertionError as exc:
            tables = [table_view(replay(w.events())[0]) for w in watchers]
            raise AssertionError(
                f"{exc}: "
                + "; ".join(
                    f"watcher {i} misses {sorted(content.keys() - t.keys())}, has extra "
                    f"{sorted(t.keys() - content.keys())}, differs on "
                    f"{sorted(k for k in t.keys() & content.keys() if t[k] != content[k])}"
                    for i, t in enumerate(tables)
                )
            ) from None
        settle = time.monotonic() - settle_began
        problems = {i: replay(w.events())[1] for i, w in enumerate(watchers)}
        assert not any(problems.values()), problems
        reports = [last_staleness_report(w.log()) for w in watchers]
        assert not [r for r in reports if r and "is stale" in r], reports

        # Nobody crashed: everyone still running; a clean exit on SIGTERM.
        assert all(w.process.poll() is None for w in watchers), "a watcher died"
        dead = [(r.engine_id, r.process.poll()) for r in chaos.live if r.process.poll() is not None]
        assert not dead, f"registrars died: {dead}"
        for registrar in chaos.live:
            registrar.signal(signal.SIGTERM)
        for registrar in chaos.live + chaos.sigtermed:
            assert registrar.wait(30) == 0, registrar.output()[-3000:]
        for registrar in chaos.sigkilled:
            assert registrar.wait(10) == -signal.SIGKILL
        # Every registrar revoked its lease on SIGTERM: the watchers see an empty table.
        wait_for(lambda: not chaos.etcd_content(), timeout=10, message="etcd empty")
        wait_for(
            lambda: all(not replay(w.events())[0] for w in watchers),
            timeout=10,
            message="every watcher's table empty",
        )
        for watcher in watchers:
            watcher.process.send_signal(signal.SIGTERM)
            assert watcher.process.wait(30) == 0, watcher.log()[-3000:]
        for output in [w.log() for w in watchers] + [
            r.output() for r in chaos.live + chaos.sigtermed + chaos.sigkilled
        ]:
            assert "Traceback" not in output, output[-3000:]

        relists = sum(w.log().count("listing again") for w in watchers)
        reconnects = sum(w.log().count("reconnecting") for w in watchers)
        stale_spells = sum(w.log().count("is stale") for w in watchers)
        events = sum(len(w.events()) for w in watchers)
        with capsys.disabled():
            print(
                f"\nchaos (seed {chaos.seed}): {CHAOS_SECONDS:g} s of faults, setup {setup:.1f} s, "
                f"settle {settle:.1f} s, total {time.monotonic() - began:.1f} s; registrars: "
                f"{chaos.next_id} started, {len(chaos.live)} live at the end; watcher events: "
                f"{events}, reconnects: {reconnects}, relists after compaction: {relists}, "
                f"stale spells: {stale_spells}"
            )
            for fault, count in sorted(chaos.faults.items()):
                print(f"  {fault}: {count}")
    finally:
        for registrar in chaos.live + chaos.sigtermed + chaos.sigkilled:
            registrar.stop()
        for watcher in watchers:
            watcher.stop()
        chaos.conn.close()
