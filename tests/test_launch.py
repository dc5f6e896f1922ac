"""``discovery launch`` against real etcd: the record lives exactly as long as the engine."""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from discovery import (
    EngineStatus,
    NoEngineAvailableError,
    Router,
    Settings,
    handoff_problem,
    list_engines,
    watch_table,
)
from discovery._engine.launch import check_command
from discovery.cli import build_parser
from discovery.testing.stand_in_engine import default_endpoint

from .helpers import (
    STAND_IN,
    Launcher,
    WatchLog,
    cli_env,
    get_kv,
    gone,
    run_cli,
    run_python,
    wait_for,
)

# A child that never sends anything and ignores SIGTERM and SIGINT.
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "print('stubborn engine up', sys.argv[1], flush=True); time.sleep(600)",
    "{event_address}",
]


@pytest.fixture
def launched(settings: Settings):
    started: list[Launcher] = []
    watch = WatchLog(settings)

    def start(engine_id: str, command: list[str], *flags: str) -> Launcher:
        started.append(Launcher(settings, engine_id, command, *flags))
        return started[-1]

    start.watch = watch
    yield start
    for launcher in started:
        launcher.stop()
    watch.stop()


def test_the_stand_in_is_registered_from_its_ready_message_and_sigterm_stops_all(
    settings: Settings, launched
) -> None:
    launcher = launched("standin-0", STAND_IN, "--label", "model=m", "--ttl", "5")
    launched.watch.wait("standin-0", "added", timeout=60)
    child, guard = launcher.child_pid(), launcher.guard_pid()
    value = json.loads(get_kv(settings.endpoints, launcher.key)["value"])
    metadata = {
        k: value.pop(k) for k in ("engine_id", "labels", "registered_at", "status", "state_address")
    }
    assert value == json.loads(json.dumps(default_endpoint()))  # exactly what it sent
    assert metadata["state_address"].startswith("tcp://127.0.0.1:")
    assert metadata["engine_id"] == "standin-0" and metadata["labels"] == {"model": "m"}
    assert metadata["status"] == "ready"
    assert os.getpgid(child) == child != os.getpgid(launcher.process.pid)  # its own group

    launcher.process.send_signal(signal.SIGTERM)
    assert launcher.wait() == 0, launcher.output()
    assert get_kv(settings.endpoints, launcher.key) is None
    assert gone(child) and gone(guard)
    out = launcher.output()
    assert "stand-in engine: SIGTERM, exiting 0" in out  # forwarded to the engine
    counts = re.search(
        r"engine events: (\d+) frames, 1 ready, (\d+) kv, (\d+) progress, 0 ignored", out
    )
    assert counts and int(counts[2]) >= 4 and int(counts[3]) >= 1, out  # 4 prompts' KV events
    # Its removal was announced: marked stopping, then deleted.
    assert launched.watch.kinds("standin-0") == ["added", "updated", "removed"]


def test_sigterm_with_a_drain_timeout_drains_while_the_engine_serves(
    settings: Settings, launched
) -> None:
    launcher = launched("drainer-0", STAND_IN, "--ttl", "30", "--drain-timeout", "2")
    launched.watch.wait("drainer-0", "added", timeout=60)
    child = launcher.child_pid()
    launcher.process.send_signal(signal.SIGTERM)
    at, event = launched.watch.wait("drainer-0", "updated")
    assert event.status == "draining" and event.record.drain_deadline is not None
    assert not gone(child)  # the engine keeps serving what it has while draining
    removed_at, _ = launched.watch.wait("drainer-0", "removed")
    assert removed_at - at >= 1.5  # the drain lasted (a revoke, not the 30 s TTL)
    assert launcher.wait() == 0, launcher.output()
    assert gone(child)
    assert launched.watch.kinds("drainer-0") == ["added", "updated", "removed"]


@pytest.mark.parametrize(
    ("how", "extra", "status"),
    [
        (signal.SIGTERM, ["--exit-status", "0"], 0),
        (signal.SIGTERM, ["--exit-status", "3"], 3),
        (signal.SIGKILL, [], 128 + signal.SIGKILL),  # the shell's convention
    ],
    ids=["exits-0", "exits-3", "sigkilled"],
)
def test_when_the_engine_ends_the_record_is_gone_within_a_second(
    launched, how: signal.Signals, extra: list[str], status: int
) -> None:
    launcher = launched("ending", [*STAND_IN, *extra], "--ttl", "30")
    launched.watch.wait("ending", "added", timeout=60)
    child = launcher.child_pid()
    sent = time.monotonic()
    os.kill(child, how)  # the engine ends by itself, as far as the launcher can tell
    removed_at, _ = launched.watch.wait("ending", "removed", timeout=10)
    assert removed_at - sent < 1.0, removed_at - sent  # revoked, not expired (TTL 30 s)
    assert launcher.wait() == status, launcher.output()
    assert gone(child)


def _answers(address: str, timeout: float = 1.0) -> bool | None:
    """GET the stand-in's request port: True (200), None (no answer in time), False (refused)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("GET", "/?hold=0")
        return connection.getresponse().status == 200
    except TimeoutError:
        return None
    except OSError:
        return False
    finally:
        connection.close()


def test_the_stand_in_answers_requests_on_its_port_unless_silent_or_dead(
    settings: Settings, launched
) -> None:
    launcher = launched("serving", [*STAND_IN, "--serve-port", "0"])
    launched.watch.wait("serving", "added", timeout=60)
    address = json.loads(get_kv(settings.endpoints, launcher.key)["value"])["coordinator_address"]
    assert address.startswith("tcp://127.0.0.1:") and address != "tcp://127.0.0.1:5555"
    assert _answers(address) is True
    child = launcher.child_pid()
    os.kill(child, signal.SIGUSR1)  # silent: a hung engine answers nothing
    wait_for(lambda: _answers(address, 0.5) is None, message="no answer while silent")
    os.kill(child, signal.SIGUSR2)
    wait_for(lambda: _answers(address), message="answers again")
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: _answers(address) is False, message="refused once dead")


def test_what_the_engine_left_in_its_group_is_killed_when_it_exits(launched, tmp_path) -> None:
    pidfile = tmp_path / "sleeper.pid"
    shell = f'sleep 300 & echo $! > {pidfile}; exec "$@"'
    launcher = launched("leaver", ["sh", "-c", shell, "sh", *STAND_IN])
    launched.watch.wait("leaver", "added", timeout=60)
    sleeper = int(pidfile.read_text())
    assert not gone(sleeper)
    os.kill(launcher.child_pid(), signal.SIGTERM)
    assert launcher.wait() == 0, launcher.output()
    wait_for(lambda: gone(sleeper), message="the sleeper left in the group killed")


@pytest.mark.parametrize("engine", ["stand-in", "stubborn"])
def test_a_sigkilled_launcher_leaves_no_engine_and_the_lease_expires(launched, engine) -> None:
    # The guard stops the engine's group: SIGTERM, then SIGKILL after --stop-timeout.
    command = STAND_IN if engine == "stand-in" else STUBBORN
    launcher = launched(f"orphan-{engine}", command, "--ttl", "2", "--stop-timeout", "2")
    if engine == "stand-in":
        launched.watch.wait(launcher.engine_id, "added", timeout=60)
    else:
        wait_for(lambda: "stubborn engine up" in launcher.output(), message="engine up")
    child, guard = launcher.child_pid(), launcher.guard_pid()
    launcher.process.kill()
    killed = time.monotonic()
    launcher.wait()
    wait_for(lambda: gone(child), timeout=2 + 5, message="engine stopped by the guard")
    wait_for(lambda: gone(guard), message="guard exited")
    if engine == "stand-in":
        removed_at, _ = launched.watch.wait(launcher.engine_id, "removed", timeout=10)
        assert removed_at - killed <= 2 + 2, removed_at - killed
        assert "stand-in engine: SIGTERM" in launcher.output()  # the guard's first signal


LAYOUT = (
    "tp_size=2,pp_size=1,num_layers_global=32,num_kv_heads_global=8,head_dim=128,dtype=bfloat16"
)


def test_the_role_comes_from_the_nested_ready_or_from_the_flag_and_the_pair_can_hand_off(
    settings: Settings, launched
) -> None:
    handoff = ["--kv-transfer-backend", "nixl", "--kv-layout", LAYOUT]
    # The nested shape names the engine's role (Megatron's engine service): it wins.
    prefill = launched("p1", [*STAND_IN, "--role", "prefill"], "--role", "decode", *handoff)
    # Megatron's flat shape names none: the flag's.
    decode = launched("d1", STAND_IN, "--role", "decode", *handoff)
    # A nested ready with Megatron's default role.
    plain = launched("a1", [*STAND_IN, "--ready-shape", "nested"])
    for engine_id in ("p1", "d1", "a1"):
        launched.watch.wait(engine_id, "added", timeout=60)
    records = {e.engine_id: e.record for e in list_engines(settings, lease_ttls=False).engines}
    assert {k: str(r.role) for k, r in records.items()} == {
        "p1": "prefill",
        "d1": "decode",
        "a1": "aggregated",
    }
    assert "the engine says role 'prefill'; it replaces the role 'decode' given" in (
        prefill.output()
    )
    assert handoff_problem(records["p1"], records["d1"]) is None
    assert "a1 has role 'aggregated'" in (handoff_problem(records["a1"], records["d1"]) or "")
    listed = run_cli(settings, "list")
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:-1]}
    assert (rows["p1"][3], rows["d1"][3], rows["a1"][3]) == ("prefill", "decode", "-")
    for launcher in (prefill, decode, plain):
        launcher.process.send_signal(signal.SIGTERM)
        assert launcher.wait() == 0, launcher.output()


def test_stop_timeout_escalates_to_sigkill(launched) -> None:
    launcher = launched("stubborn", STUBBORN, "--stop-timeout", "1")
    wait_for(lambda: "stubborn engine up" in launcher.output(), message="engine up")
    child = launcher.child_pid()
    launcher.process.send_signal(signal.SIGINT)
    assert launcher.wait() == 128 + signal.SIGKILL, launcher.output()
    assert gone(child)
    assert "engine still running: SIGKILL to its process group" in launcher.output()


@pytest.mark.parametrize("engine", ["silent", "capabilities-shape"])
def test_no_valid_ready_within_the_ready_timeout_stops_the_engine(
    settings: Settings, launched, engine: str
) -> None:
    if engine == "silent":
        command = [sys.executable, "-c", "import time, sys; time.sleep(600)", "{event_address}"]
    else:
        capabilities = {**default_endpoint()["capabilities"], "role": "prefill"}
        command = [*STAND_IN, "--ready", json.dumps(capabilities)]
    launcher = launched("unready", command, "--ready-timeout", "3")
    child = launcher.child_pid()
    assert launcher.wait() == 1, launcher.output()
    out = launcher.output()
    assert "no valid ready message within the ready timeout (3 s); stopping the engine" in out
    if engine == "capabilities-shape":
        assert "ready payload fits no shape: accepted are flat" in out
        assert "1 rejected" in out
    assert gone(child)
    assert get_kv(settings.endpoints, launcher.key) is None
    assert launched.watch.kinds("unready") == []


def test_a_second_launcher_with_the_same_engine_id_is_refused(settings, launched) -> None:
    first = launched("twin", STAND_IN)
    launched.watch.wait("twin", "added", timeout=60)
    lease = get_kv(settings.endpoints, first.key)["lease"]
    second = launched("twin", STAND_IN)
    child = second.child_pid()
    assert second.wait() == 1, second.output()
    assert f"engine id 'twin' is already registered at '{first.key}' by lease {lease:016x}" in (
        second.output()
    )
    assert gone(child)
    assert get_kv(settings.endpoints, first.key)["lease"] == lease
    assert first.process.poll() is None


@pytest.mark.parametrize("hidden", ["zmq", "msgpack"])
def test_without_the_launch_extra_launch_says_what_to_install(settings, hidden: str) -> None:
    code = (
        f"import sys; sys.modules[{hidden!r}] = None\n"
        "from discovery.cli import main\n"
        "sys.exit(main(['launch', '--', 'engine', '{event_address}']))\n"
    )
    returncode, _, err = run_python(code, cli_env(settings))
    assert returncode == 2, err
    assert f"({hidden} is missing): pip install 'discovery[launch]'" in err
    assert "Traceback" not in err


def test_bad_commands(settings: Settings) -> None:
    cases = [
        ([], 2, "give the engine command after --"),
        (["--", "engine", "--port", "1"], 2, "the engine command has no {event_address}"),
        (["--ready-timeout", "0", "--", "e", "{event_address}"], 2, "ready timeout must be"),
        (["--", "/nonexistent/engine", "{event_address}"], 127, "cannot start /nonexistent"),
    ]
    for args, status, message in cases:
        result = run_cli(settings, "launch", *args)
        assert result.returncode == status, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_the_readme_megatron_example_is_a_valid_command_line() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"```bash\npip install 'discovery\[launch\]'.*?\n(discovery launch .*?)```",
                      readme, re.S).group(1)  # fmt: skip
    block = block.replace("\\\n", " ")  # line continuations, as the shell reads them
    argv = shlex.split(block.replace("<Megatron arguments>", "--tensor-model-parallel-size 8"))
    args = build_parser().parse_args(argv[1:])
    assert args.func.__name__ == "cmd_launch"
    assert (args.engine_id, args.label) == ("llama-0", ["model=llama-3-8b"])
    command = args.engine_command[1:]
    check_command(command)
    assert command[:2] == ["torchrun", "--nproc-per-node"]
    assert "--dynamo-parent-event-address" in command


# -- hung engines under discovery launch --------------------------------------------------


def _first(watch: WatchLog, engine_id: str, status: str, after: float) -> float | None:
    """When ``engine_id``'s first event with ``status`` after ``after`` arrived, if one did."""
    with watch._cond:
        return next(
            (
                at
                for at, e in watch.events
                if e.engine_id == engine_id and e.status.value == status and at >= after
            ),
            None,
        )


def _watching_for_stalls(launcher: Launcher) -> None:
    wait_for(
        lambda: "watching for stalls" in launcher.output(),
        timeout=10,
        message="the launcher's first progress heartbeat",
    )


def test_a_sigstopped_engine_is_stalled_skipped_and_back_after_sigcont(
    settings: Settings, launched
) -> None:
    stall = 2.0
    launcher = launched("frozen", STAND_IN, "--ttl", "3", "--stall-timeout", str(stall))
    launched.watch.wait("frozen", "added", timeout=60)
    child = launcher.child_pid()
    table = watch_table(settings).start()
    router = Router(table)
    try:
        _watching_for_stalls(launcher)
        os.kill(child, signal.SIGSTOP)
        stopped = time.monotonic()
        stalled_at = wait_for(
            lambda: _first(launched.watch, "frozen", "stalled", stopped), timeout=stall + 5
        )
        assert stalled_at - stopped <= stall + 1.0, stalled_at - stopped
        # This table is a watcher of its own: once it has the mark, no pick of it.
        wait_for(lambda: table.get("frozen").status is EngineStatus.STALLED, message="table")
        with pytest.raises(NoEngineAvailableError):
            router.pick([1, 2, 3], 4)
        os.kill(child, signal.SIGCONT)
        resumed = time.monotonic()
        ready_at = wait_for(lambda: _first(launched.watch, "frozen", "ready", resumed), timeout=5)
        assert ready_at - resumed <= 1.0, ready_at - resumed
        wait_for(lambda: table.get("frozen").status is EngineStatus.READY, message="table")
        with router.pick([1, 2, 3], 4) as handle:
            assert handle.engine_id == "frozen"
    finally:
        table.stop()
    assert "marking it stalled" in launcher.output()


def test_stall_action_stop_ends_the_engine_and_the_record_at_once(
    settings: Settings, launched
) -> None:
    stall = 1.0
    launcher = launched(
        "doomed", STAND_IN, "--ttl", "30", "--stall-timeout", str(stall), "--stall-action", "stop"
    )
    launched.watch.wait("doomed", "added", timeout=60)
    child = launcher.child_pid()
    _watching_for_stalls(launcher)
    os.kill(child, signal.SIGSTOP)
    stopped = time.monotonic()
    removed_at, _ = launched.watch.wait("doomed", "removed", timeout=10)
    # Marked within S + 1 s (as above), then the record goes within 1 s of that.
    assert removed_at - stopped <= stall + 1.0 + 1.0, removed_at - stopped
    assert launcher.wait() == 124, launcher.output()
    assert gone(child)
    assert get_kv(settings.endpoints, launcher.key) is None
    out = launcher.output()
    assert "the stall action is stop" in out and "stand-in engine: SIGTERM" in out


def test_an_engine_that_sends_nothing_after_ready_is_never_stalled(
    settings: Settings, launched
) -> None:
    command = [*STAND_IN, "--no-progress"]
    launcher = launched("old-megatron", command, "--ttl", "3", "--stall-timeout", "0.5")
    launched.watch.wait("old-megatron", "added", timeout=60)
    child = launcher.child_pid()
    os.kill(child, signal.SIGSTOP)
    try:
        frozen = time.monotonic()
        # Eight stall timeouts and more than a TTL pass: the lease lives, the status stays.
        wait_for(lambda: time.monotonic() - frozen > 4.0, timeout=10, message="4 s frozen")
        assert launched.watch.kinds("old-megatron") == ["added"]
        assert json.loads(get_kv(settings.endpoints, launcher.key)["value"])["status"] == "ready"
        assert "watching for stalls" not in launcher.output()
    finally:
        os.kill(child, signal.SIGCONT)


def test_a_fixed_event_address_is_bound_and_a_busy_one_refused(
    settings: Settings, launched
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    launcher = launched("pinned", STAND_IN, "--event-address", address)
    launched.watch.wait("pinned", "added", timeout=60)
    assert f"listening for engine events on {address}" in launcher.output()
    result = run_cli(
        settings, "launch", "--event-address", address, "--ready-timeout", "5", "--", *STAND_IN
    )
    assert result.returncode == 2, result.stderr
    assert f"cannot bind the engine-event socket on {address}: the port is in use" in (
        result.stderr
    )
