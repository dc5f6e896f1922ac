"""The command line against real etcd."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from discovery import Connection, Settings, register_engine
from discovery._records.codec import KeySpace, encode
from discovery._records.record import EngineRecord
from discovery.cli import build_parser
from discovery.cli._args import settings_argv, settings_from_args

from .helpers import Registrar, cli_env, get_kv, make_endpoint, raw_call, run_cli, wait_for


def test_list_json_and_table(settings: Settings) -> None:
    with (
        register_engine(
            make_endpoint(1),
            engine_id="a",
            ttl=30,
            labels={"zone": "z1"},
            role="decode",
            settings=settings,
        ),
        register_engine(make_endpoint(2), engine_id="b", ttl=30, settings=settings),
    ):
        result = run_cli(settings, "list", "--format", "json")
        assert result.returncode == 0, result.stderr
        listed = json.loads(result.stdout)
        engines = {e["engine_id"]: e for e in listed["engines"]}
        assert set(engines) == {"a", "b"}
        assert engines["a"]["labels"] == {"zone": "z1"} and engines["a"]["role"] == "decode"
        assert "role" not in engines["b"]  # aggregated: the absent role
        assert 0 < engines["a"]["ttl"] <= 30 and engines["a"]["lease"] > 0
        assert engines["b"]["capabilities"] == make_endpoint(2).capabilities.to_dict()
        assert listed["revision"] > 0

        for fmt in ("table", "wide"):
            table = run_cli(settings, "list", "-o", fmt)
            assert table.returncode == 0
            lines = table.stdout.splitlines()
            assert lines[0].split()[:5] == ["ENGINE", "STATUS", "VERSION", "ROLE", "ADDRESS"]
            rows = {line.split()[0]: line.split() for line in lines[1:-1]}
            assert rows["a"][1:4] == ["ready", "-", "decode"] and rows["a"][-1] == "zone=z1"
            assert rows["b"][1:4] == ["ready", "-", "-"]  # aggregated: the absent role
            assert lines[-1] == "(2 engines)"


def test_list_refuses_a_record_that_lies_saying_why(settings: Settings) -> None:
    """Issue 43 item 3: a 1 MB record and one claiming 10**400 KV blocks, put by hand, are
    not listed (the JSON stays small); stderr names each key and why, JSON's "refused" list
    too, and the tables show each as a refused row (its key, why) after the engines."""
    liar = json.loads(encode(EngineRecord(engine_id="liar", endpoint=make_endpoint(1))))
    liar["capabilities"]["total_kv_blocks"] = 10**400
    huge = {
        **json.loads(encode(EngineRecord(engine_id="huge", endpoint=make_endpoint(2)))),
        "padding": "x" * 1_000_000,
    }
    conn = Connection(settings)
    try:
        for engine_id, value in (("liar", liar), ("huge", huge)):
            key = settings.keyspace.key(engine_id)
            raw_call(conn, lambda client, k=key, v=value: client.put(k, json.dumps(v)))
        with register_engine(make_endpoint(3), engine_id="good", ttl=30, settings=settings):
            result = run_cli(settings, "list", "--format", "json")
            tables = {fmt: run_cli(settings, "list", "-o", fmt) for fmt in ("table", "wide")}
    finally:
        conn.close()
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert [e["engine_id"] for e in listed["engines"]] == ["good"]
    assert len(result.stdout) < 10_000
    warnings = result.stderr.splitlines()
    assert len(warnings) == 2, warnings
    assert any("/liar" in w and "total_kv_blocks is about 10**400, over" in w for w in warnings)
    assert any("/huge" in w and "over the 16384-byte limit of a record" in w for w in warnings)
    liar_key, huge_key = settings.keyspace.key("liar"), settings.keyspace.key("huge")
    refused = {r["key"]: r["reason"] for r in listed["refused"]}
    assert set(refused) == {liar_key, huge_key}
    assert "total_kv_blocks is about 10**400, over" in refused[liar_key]
    assert refused[huge_key].endswith("over the 16384-byte limit of a record")
    for fmt, table in tables.items():
        assert table.returncode == 0, (fmt, table.stderr)
        lines = table.stdout.splitlines()
        assert lines[0].startswith("ENGINE") and lines[1].startswith("good "), fmt
        assert lines[2:4] == ["(1 engines)", f"{'REFUSED KEY':<{len(liar_key)}}  WHY"], fmt
        rows = dict(line.split(None, 1) for line in lines[4:6])
        assert rows == refused, fmt
        assert lines[6] == "(2 refused)", fmt


def test_list_warns_once_of_each_skipped_value_and_shows_keys_as_etcdctl(
    settings: Settings,
) -> None:
    prefix = KeySpace(settings.root, settings.namespace).prefix
    with Connection(settings) as conn:
        conn.replace(f"{prefix}bad", b"{not json", 0)
        raw_call(conn, lambda c: c.put(f"{prefix}k".encode() + b"\xff\xfe", b"{}"))
        for fmt in ("table", "wide", "json"):
            result = run_cli(settings, "list", "-o", fmt)
            assert result.returncode == 0, result.stderr
            warnings = result.stderr.splitlines()
            if fmt != "json":  # the tables show them as refused rows, and warn of none
                assert warnings == [], (fmt, warnings)  # wide's watcher does not warn again
                warnings = [line for line in result.stdout.splitlines() if line.startswith("/")]
            assert len(warnings) == 2, warnings  # each bad value once
            assert any(f"{prefix}bad" in line for line in warnings), warnings
            # byte 0xff as etcdctl escapes it, once (not \\xff)
            assert any(f"{prefix}k\\xff\\xfe" in line for line in warnings), warnings
            shown = result.stderr if fmt == "json" else result.stdout  # JSON escapes "\\"
            assert "\\\\" not in shown


def test_list_takes_set_based_selectors(settings: Settings) -> None:
    with contextlib.ExitStack() as stack:
        for i, (name, labels) in enumerate(
            (("web", {"tier": "web"}), ("batch", {"tier": "x"}), ("bare", {}))
        ):
            stack.enter_context(
                register_engine(make_endpoint(i), engine_id=name, labels=labels, settings=settings)
            )

        def listed(*selectors: str) -> list[str]:
            flags = [arg for selector in selectors for arg in ("--selector", selector)]
            result = run_cli(settings, "list", "-o", "json", *flags)
            assert result.returncode == 0, result.stderr
            return sorted(e["engine_id"] for e in json.loads(result.stdout)["engines"])

        assert listed("tier notin (x)") == ["bare", "web"]  # no tier: not x either
        assert listed("tier notin (x)", "tier") == ["web"]  # repeated flags: all must hold
        assert listed("!tier") == ["bare"]
        assert listed("tier in (x, web)") == ["batch", "web"]


def test_register_with_a_role_and_its_hand_off_layout(settings: Settings) -> None:
    layout = (
        "tp_size=4,pp_size=1,num_layers_global=32,num_kv_heads_global=8,head_dim=128,dtype=bfloat16"
    )
    registrar = Registrar(
        settings,
        "p1",
        ttl=30,
        extra=["--role", "prefill", "--kv-transfer-backend", "nixl", "--kv-layout", layout],
    )
    key = settings.keyspace.key("p1")
    try:
        kv = wait_for(lambda: get_kv(settings.endpoints, key), message="registration")
        stored = json.loads(kv["value"])
        assert (stored["role"], stored["kv_transfer_backend"]) == ("prefill", "nixl")
        assert stored["kv_layout"] == {
            "tp_size": 4,
            "pp_size": 1,
            "num_layers_global": 32,
            "num_kv_heads_global": 8,
            "head_dim": 128,
            "dtype": "bfloat16",
            "num_ssm_layers_global": 0,
            "num_speculative_tokens": 0,
        }
    finally:
        registrar.stop()


def test_register_from_endpoint_file_then_deregister(settings: Settings, tmp_path) -> None:
    value = EngineRecord(engine_id="from-file", endpoint=make_endpoint(4), labels={"zone": "z"})
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(value.to_value()))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "discovery",
            "register",
            "--endpoint-file",
            str(path),
            "--label",
            "model=m",
            "--ttl",
            "30",
        ],
        env=cli_env(settings),
        stderr=subprocess.PIPE,
        text=True,
    )
    key = settings.keyspace.key("from-file")
    try:
        kv = wait_for(lambda: get_kv(settings.endpoints, key), message="registration")
        stored = json.loads(kv["value"])
        assert stored["labels"] == {"zone": "z", "model": "m"}  # file labels + flags
        result = run_cli(settings, "deregister", "from-file")
        assert result.returncode == 0, result.stderr
        assert (
            f"removed engine 'from-file' at {key}: revoked lease {kv['lease']:016x}"
            in result.stdout
        )
        # The live registrar notices and registers again: self-healing.
        wait_for(
            lambda: (kv2 := get_kv(settings.endpoints, key)) and kv2["lease"] != kv["lease"],
            message="re-registration after deregister",
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
        assert get_kv(settings.endpoints, key) is None
    finally:
        process.kill()
        process.wait()
        process.stderr.close()


def test_deregister_unknown_engine_fails(settings: Settings) -> None:
    result = run_cli(settings, "deregister", "nobody")
    assert result.returncode == 1
    assert "no engine 'nobody'" in result.stderr


def test_bad_input_exits_2_with_a_clear_message(settings: Settings, tmp_path) -> None:
    cases = [
        (["register"], "--coordinator-address"),
        (
            [
                "register",
                "--coordinator-address",
                "x",
                "--context-length",
                "0",
                "--kv-cache-block-size",
                "1",
                "--total-kv-blocks",
                "1",
                "--max-num-seqs",
                "1",
                "--max-num-batched-tokens",
                "1",
                "--bos-token-id",
                "0",
            ],
            "context_length must be positive",
        ),
        (["register", "--endpoint-file", str(tmp_path / "missing.json")], "cannot read"),
        (["register", "--endpoint-file", __file__], "is not JSON"),
        (["list", "--endpoints", "ftp://x:1"], "scheme must be http or https"),
        (
            ["register", "--endpoint-file", str(tmp_path / "e.json"), "--engine-id", "a/b"],
            "engine id",
        ),
        (
            ["watch", "--selector", "model=m", "--selector", "tier notin (x y)"],
            "discovery watch: invalid selector 'tier notin (x y)', column 15: found 'y', "
            "expected ',' or ')'",
        ),
        (["list", "--selector", "gpu,!"], "invalid selector 'gpu,!', column 6 (term '!')"),
        (["top", "--selector", "n>1"], "'>' is not supported (Kubernetes' numeric Gt and Lt)"),
        (["register", "--role", "prefil"], "argument --role: invalid choice: 'prefil'"),
        (["launch", "--kv-transfer-backend", "ucx"], "invalid choice: 'ucx'"),
        (
            [
                "register",
                "--kv-layout",
                "tp_size=2,pp_size=1,num_layers_global=32,num_kv_heads_global=8,head_dim=128,"
                "dtype=bf16",
            ],
            "argument --kv-layout: kv_layout dtype 'bf16' is not one of bfloat16",
        ),
        (["launch", "--kv-layout", "tp=2"], "'tp=2' must be KEY=VALUE with KEY one of tp_size"),
        (["list", "--log-level", "loud"], "'loud' is not a logging level"),
    ]
    (tmp_path / "e.json").write_text(json.dumps(make_endpoint().to_dict()))
    for args, message in cases:
        result = run_cli(settings, *args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_duplicate_id_exits_1(settings: Settings) -> None:
    with register_engine(make_endpoint(), engine_id="taken", ttl=30, settings=settings) as reg:
        registrar = Registrar(settings, "taken", ttl=30)
        try:
            assert registrar.wait(30) == 1
            assert f"lease {reg.lease_id:016x}" in registrar.output()
        finally:
            registrar.stop()


def _watch(settings: Settings, *args: str) -> subprocess.Popen:
    """A ``discovery watch`` process whose stdout the test reads line by line."""
    return subprocess.Popen(
        [sys.executable, "-m", "discovery", "watch", *args],
        env=cli_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_watch_jsonl_reports_a_sigkilled_registrar_within_ttl_plus_2s(settings: Settings) -> None:
    watch = _watch(settings, "--format", "jsonl")
    registrar = Registrar(settings, "victim", ttl=3)
    try:
        added = json.loads(watch.stdout.readline())
        assert set(added) == {
            "type", "engine_id", "key", "revision", "endpoint",
            "labels", "registered_at", "status", "drain_deadline", "weight_version",
            "state_address", "role", "kv_transfer_backend", "kv_layout",
        }  # fmt: skip
        assert (added["role"], added["kv_transfer_backend"]) == ("aggregated", None)
        assert (added["type"], added["engine_id"]) == ("added", "victim")
        assert added["endpoint"]["coordinator_address"] == "tcp://victim:5555"
        registrar.signal(signal.SIGKILL)
        killed = time.monotonic()
        removed = json.loads(watch.stdout.readline())  # blocks until the next event
        delay = time.monotonic() - killed
        assert (removed["type"], removed["engine_id"]) == ("removed", "victim")
        assert removed["revision"] > added["revision"]
        assert delay <= 3 + 2, delay
        watch.send_signal(signal.SIGTERM)
        assert watch.wait(10) == 0
    finally:
        registrar.stop()
        watch.kill()
        watch.wait()
        watch.stdout.close()


def test_watch_text_format(settings: Settings) -> None:
    with register_engine(make_endpoint(5), engine_id="texty", labels={"k": "v"}, settings=settings):
        watch = _watch(settings)
        try:
            line = watch.stdout.readline().split()
            assert line[:3] == ["added", "texty", make_endpoint(5).coordinator_address]
            assert line[3] == "ready" and line[-1] == "k=v"  # aggregated: no role shown
            # SIGINT right away: the signal may land on any thread, it must still stop it.
            watch.send_signal(signal.SIGINT)
            assert watch.wait(10) == 0
        finally:
            watch.kill()
            watch.wait()
            watch.stdout.close()


def test_signals_stop_the_cli_whichever_thread_receives_them(settings: Settings) -> None:
    """A signal the OS hands to a gRPC thread must still wake the main thread (it did not)."""
    with register_engine(make_endpoint(), engine_id="sig", settings=settings):
        for sig in [signal.SIGINT, signal.SIGTERM] * 10:
            watch = _watch(settings)
            try:
                assert watch.stdout.readline().startswith("added")
                watch.send_signal(sig)
                assert watch.wait(10) == 0
            finally:
                watch.kill()
                watch.wait()
                watch.stdout.close()


@pytest.mark.parametrize("allow_insecure_auth", [True, False])
def test_settings_flags_give_back_the_settings(
    allow_insecure_auth: bool, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the demo hands its engine processes: every setting but the password itself."""
    for name in [k for k in os.environ if k.startswith("DISCOVERY_")]:
        monkeypatch.delenv(name)
    password_file = tmp_path / "password"
    password_file.write_text("pw")
    settings = Settings(
        endpoints="http://a:1,http://b:2",
        root="/r",
        namespace="ns",
        dial_timeout=2.5,
        request_timeout=1.5,
        username="u" if allow_insecure_auth else None,
        password_file=str(password_file) if allow_insecure_auth else None,
        allow_insecure_auth=allow_insecure_auth,
        member_sync=not allow_insecure_auth,  # both values of both switches
        member_sync_interval=4.5,
    )
    argv = settings_argv(settings)
    assert ("--allow-insecure-auth" in argv) is allow_insecure_auth
    assert ("--no-member-sync" in argv) is allow_insecure_auth
    assert settings_from_args(build_parser().parse_args(["list", *argv])) == settings
