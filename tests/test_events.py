"""EngineEventReceiver fed by a rank zero that sends Megatron's frames, registering on the
memory port and on real etcd (``store``)."""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import socket
import time

import msgpack
import pytest

from discovery import (
    ClosedError,
    ConfigurationError,
    EngineConflictError,
    EngineEventReceiver,
    EngineRole,
    EngineStatus,
    InvalidRecordError,
    ReceiverState,
    Registration,
    Settings,
    drain,
    register_engine,
    undrain,
)
from discovery._engine.events import READY_SHAPES, decode_frame, parse_ready
from discovery.testing.stand_in_engine import default_endpoint, nested_ready
from discovery.testing.stand_in_engine import main as stand_in_main

from .conftest import Store
from .helpers import (
    MEGATRON_FIELDS,
    RankZero,
    WatchLog,
    caps_kwargs,
    get_kv,
    make_endpoint,
    make_layout,
    wait_for,
)


class MegatronPolicy(str, enum.Enum):  # noqa: UP042 - Megatron's is (str, Enum)
    """Megatron's PrefixCachingCoordinatorPolicy: a str-valued Enum (wire_contract.md)."""

    FIRST_PREFIX_BLOCK = "first_prefix_block"


def megatron_to_dict(address: str = "tcp://10.9.0.1:41000", **capabilities) -> dict:
    """What Megatron's InferenceEngineEndpoint.to_dict() returns (dataclasses.asdict)."""
    values = {
        **caps_kwargs(total_kv_blocks=4095, max_num_batched_tokens=8192),
        "logical_data_parallel_size": 1,
        "prefix_caching_coordinator_policy": MegatronPolicy.FIRST_PREFIX_BLOCK,
    }
    values.update(capabilities)
    assert tuple(values) == MEGATRON_FIELDS
    return {"coordinator_address": address, "capabilities": values}


@pytest.fixture
def receiver(store: Store):
    receiver = EngineEventReceiver(engine_id="rz-0", ttl=5, labels={"model": "m"}, **store.using())
    receiver.start()
    yield receiver
    receiver.close()


@pytest.fixture
def rank_zero(receiver: EngineEventReceiver):
    sender = RankZero(receiver.address)
    yield sender
    sender.close()


def _registered_from(
    receiver: EngineEventReceiver, payload: object, settings: Settings
) -> tuple[Registration, dict]:
    """Send ``payload`` as rank zero's ready message: the registration and the stored value."""
    sender = RankZero(receiver.address)
    try:
        sender.send("ready", payload)
        registration = receiver.wait_registered(timeout=10)
    finally:
        sender.close()
    return registration, json.loads(get_kv(settings.endpoints, registration.key)["value"])


def _frames_seen(receiver: EngineEventReceiver, count: int) -> None:
    wait_for(lambda: receiver.health().frames >= count, message=f"{count} frames handled")


def test_megatron_frames_register_exactly_the_ready_payload(
    store: Store, receiver: EngineEventReceiver, rank_zero: RankZero
) -> None:
    assert receiver.address.startswith("tcp://127.0.0.1:")
    payload = megatron_to_dict()
    rank_zero.send("ready", payload)
    rank_zero.send("stored", {"block_hashes": [101], "token_ids": [1, 2]})
    rank_zero.send("removed", {"block_hashes": [101]})
    registration = receiver.wait_registered(timeout=10)
    assert receiver.state is ReceiverState.REGISTERED
    value = json.loads(store.get(registration.key).value)
    metadata = {
        k: value.pop(k) for k in ("engine_id", "labels", "registered_at", "status", "state_address")
    }
    assert value == json.loads(json.dumps(payload))  # Megatron's to_dict(), unchanged
    assert metadata["engine_id"] == "rz-0" and metadata["labels"] == {"model": "m"}
    assert metadata["status"] == "ready"
    assert metadata["state_address"] == receiver.state_address
    _frames_seen(receiver, 3)
    health = receiver.health()
    assert (health.frames, health.ready, health.kv, health.ignored) == (3, 1, 2, 0)
    assert (health.malformed, health.rejected) == (0, 0)
    receiver.close()
    assert store.get(registration.key) is None  # close() revoked the lease
    assert receiver.state is ReceiverState.CLOSED


def test_bad_frames_are_counted_logged_and_register_nothing(
    store: Store,
    receiver: EngineEventReceiver,
    rank_zero: RankZero,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="discovery")
    malformed = [
        b"\xc1",  # a byte msgpack never uses
        b"\x92\xa5ready",  # truncated
        msgpack.packb({"kind": "ready"}),  # not a pair
        msgpack.packb([1, {}]),  # kind not a string
        msgpack.packb(["ready"]),  # no payload
    ]
    for frame in malformed:
        rank_zero.send_raw(frame)
    rank_zero.send("stored", {"block_hashes": [7]})
    rank_zero.send("stored", {"block_hashes": ["seven"]})  # not a hash: malformed
    rank_zero.send("removed", {"hashes": [7]})  # no block_hashes: malformed
    rank_zero.send("a-kind-from-the-future", None)
    rank_zero.send("handoff_imported", {"request_id": 7})  # a fork's kind: nobody uses it
    caps = megatron_to_dict()["capabilities"]
    rejected = [
        "not a map",
        {**caps, "role": "prefill"},  # capabilities with a role, but no address nor engine
        caps,  # bare capabilities
        {"something": "else"},
        {"coordinator_address": "tcp://x:1", "capabilities": {"context_length": 1}},
        megatron_to_dict(context_length=0),
        megatron_to_dict(prefix_caching_coordinator_policy=7),  # a string is kept, if a name
        {**megatron_to_dict(), "role": 7},
        {**megatron_to_dict(), "role": "x" * 300},  # an unknown role is kept, if a name
        {"coordinator_address": "tcp://x:1", "engine": {**caps, "role": ["decode"]}},
    ]
    for payload in rejected:
        rank_zero.send("ready", payload)
    total = len(malformed) + 5 + len(rejected)
    _frames_seen(receiver, total)
    health = receiver.health()
    assert (health.malformed, health.kv, health.ignored) == (7, 1, 2)
    assert (health.rejected, health.ready) == (10, 0)
    assert health.state is ReceiverState.WAITING
    assert store.get(store.settings.keyspace.key("rz-0")) is None
    log = caplog.text
    assert "not msgpack (FormatError" in log and "not a [kind, payload] pair" in log
    assert "block hash that is not a 64-bit integer" in log and "no block_hashes list" in log
    assert f"ready payload fits no shape: accepted are {READY_SHAPES}" in log
    assert "flat ready payload is missing field 'kv_cache_block_size'" in log
    assert "context_length must be positive" in log
    assert "role must be a string" in log
    assert "nothing registered" in log
    with pytest.raises(TimeoutError, match="no valid ready message"):
        receiver.wait_registered(timeout=0.1)
    # Still listening: a valid ready after all that registers.
    rank_zero.send("ready", megatron_to_dict())
    receiver.wait_registered(timeout=10)
    assert health.last_error and "nothing registered" in health.last_error


def test_a_later_ready_with_another_endpoint_updates_the_record_atomically(
    store: Store, receiver: EngineEventReceiver, rank_zero: RankZero
) -> None:
    changes = WatchLog(**store.using())
    try:
        rank_zero.send("ready", megatron_to_dict("tcp://10.9.0.1:41000"))
        registration = receiver.wait_registered(timeout=10)
        first = store.get(registration.key)
        rank_zero.send("ready", megatron_to_dict("tcp://10.9.0.1:41000"))  # the same again
        rank_zero.send("ready", {**megatron_to_dict("tcp://10.9.0.2:41000"), "role": "decode"})
        _, updated = changes.wait("rz-0", "updated")
        assert updated.endpoint.coordinator_address == "tcp://10.9.0.2:41000"
        assert updated.record.role is EngineRole.DECODE
        assert dict(updated.labels) == {"model": "m"}
        second = store.get(registration.key)
        assert second.lease == first.lease  # same lease: one put, never absent
        assert second.mod_revision == updated.revision
        assert changes.kinds("rz-0") == ["added", "updated"]  # the repeat wrote nothing
        assert receiver.health().ready == 3
    finally:
        changes.stop()


def test_the_engines_role_wins_over_the_one_given_and_an_unknown_one_is_kept(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    with EngineEventReceiver(
        engine_id="roled", role="decode", labels={"role": "x"}, **store.using()
    ) as receiver:
        changes = WatchLog(**store.using())
        sender = RankZero(receiver.address)
        try:
            sender.send("ready", {**megatron_to_dict(), "role": "prefill"})
            registration = receiver.wait_registered(timeout=10)
            assert registration.record.role is EngineRole.PREFILL
            value = json.loads(store.get(registration.key).value)
            assert value["role"] == "prefill" and value["labels"] == {"role": "x"}
            sender.send("ready", {**megatron_to_dict(), "role": "encode"})  # a newer role
            _, updated = changes.wait("roled", "updated")
        finally:
            sender.close()
            changes.stop()
        assert updated.record.role == "encode" and not isinstance(updated.record.role, EngineRole)
        assert json.loads(store.get(registration.key).value)["role"] == "encode"
    assert "the engine says role 'prefill'; it replaces the role 'decode' given" in caplog.text


def test_a_refused_registration_fails_the_receiver(store: Store) -> None:
    with register_engine(make_endpoint(), engine_id="taken", ttl=30, **store.using()) as holder:
        with EngineEventReceiver(engine_id="taken", **store.using()) as receiver:
            sender = RankZero(receiver.address)
            try:
                sender.send("ready", megatron_to_dict())
                with pytest.raises(EngineConflictError, match="already registered"):
                    receiver.wait_registered(timeout=30)
                assert receiver.state is ReceiverState.FAILED
                assert isinstance(receiver.error, EngineConflictError)
                sender.send("ready", megatron_to_dict())  # registers nothing more
                _frames_seen(receiver, 2)
            finally:
                sender.close()
        assert store.get(holder.key).lease == holder.lease_id


def test_asyncio_use(store: Store) -> None:
    states: list[ReceiverState] = []

    async def main() -> tuple[str, int]:
        async with EngineEventReceiver(engine_id="aio", **store.using()) as receiver:
            receiver.subscribe(states.append)
            sender = RankZero(receiver.address)
            try:
                sender.send("ready", megatron_to_dict())
                registration = await receiver.await_registered(timeout=10)
            finally:
                sender.close()
            return registration.key, registration.lease_id

    key, lease = asyncio.run(main())
    assert lease and store.get(key) is None
    wait_for(lambda: states == [ReceiverState.REGISTERED, ReceiverState.CLOSED], message="states")


def test_misuse_and_bad_arguments(store: Store) -> None:
    with pytest.raises(InvalidRecordError, match="engine id"):
        EngineEventReceiver(engine_id="a/b", **store.using())
    with pytest.raises(InvalidRecordError, match="ttl must be a positive number"):
        EngineEventReceiver(ttl=0, **store.using())
    with pytest.raises(InvalidRecordError, match="label"):
        EngineEventReceiver(labels={"bad key": "v"}, **store.using())
    with pytest.raises(ConfigurationError, match="cannot bind the engine-event socket"):
        EngineEventReceiver(host="203.0.113.300", **store.using()).start()
    receiver = EngineEventReceiver(**store.using())
    assert receiver.engine_id  # {hostname}-{pid}-{random}
    receiver.close()
    with pytest.raises(ClosedError):
        receiver.start()
    with pytest.raises(ClosedError):
        receiver.wait_registered(timeout=1)


def test_frame_and_payload_parsing() -> None:
    assert decode_frame(msgpack.packb(["stored", {"a": [1]}], use_bin_type=True)) == (
        "stored",
        {"a": [1]},
    )
    with pytest.raises(ValueError, match="not msgpack"):
        decode_frame(msgpack.packb(["ready", {}]) + b"\x00")  # extra data
    message = parse_ready(megatron_to_dict())
    assert message.endpoint.to_dict() == megatron_to_dict() and message.role is None
    with pytest.raises(InvalidRecordError, match="is a list, not a map"):
        parse_ready([])
    with pytest.raises(InvalidRecordError, match="its keys: \\['a', 'b'\\]"):
        parse_ready({"b": 1, "a": 2})


# -- every ready shape Megatron's code sends ------------------------------------------------


class StubEngine:
    """The attributes of a DynamicInferenceEngine that Megatron's ready builders read."""

    def __init__(self, **context: object) -> None:
        values = {
            "max_sequence_length": 16384,
            "block_size_tokens": 64,
            "max_requests": 32,
            "max_tokens": 8192,
            "enable_prefix_caching": True,
            "kv_block_allocator": type("Allocator", (), {"pool_size": 2049})(),
        }
        values.update(context)
        self.context = type("Context", (), values)()
        self.controller = type("Controller", (), {"tokenizer": type("T", (), {"bos": 151643})()})()


def megatron_engine_metadata(engine, role: str) -> dict:
    """Megatron's ``engine_metadata`` (dynamo/protocol.py, pull-request/6675), verbatim."""
    allocator = engine.context.kv_block_allocator
    tokenizer = engine.controller.tokenizer
    bos_token_id = next(
        (
            int(value)
            for name in ("bos", "bos_token_id", "eod")
            if (value := getattr(tokenizer, name, None)) is not None
        ),
        0,
    )
    return {
        "context_length": int(engine.context.max_sequence_length),
        "kv_cache_block_size": int(engine.context.block_size_tokens),
        "total_kv_blocks": max(0, int(allocator.pool_size) - 1),
        "max_num_seqs": int(engine.context.max_requests),
        "max_num_batched_tokens": int(engine.context.max_tokens),
        "role": role,
        "bos_token_id": bos_token_id,
        "enable_prefix_caching": bool(engine.context.enable_prefix_caching),
        "logical_data_parallel_size": 1,
    }


def megatron_nested_ready(address: str, engine, role: str) -> dict:
    """engine_service.py's ready(): ``{"coordinator_address": ..., "engine": metadata}``."""
    return {"coordinator_address": address, "engine": megatron_engine_metadata(engine, role)}


def megatron_02f201a3_to_dict(address: str, engine) -> dict:
    """``InferenceEngineEndpoint.from_engine(...).to_dict()`` at Megatron-LM 02f201a3:
    eight capability fields, no policy (dataclasses.asdict order)."""
    metadata = megatron_engine_metadata(engine, "aggregated")
    metadata.pop("role")
    order = (*MEGATRON_FIELDS[:8],)
    return {"coordinator_address": address, "capabilities": {k: metadata[k] for k in order}}


SHAPES = {
    "flat, with the policy (endpoint module with prefix_caching_coordinator_policy)": (
        lambda engine: megatron_to_dict("tcp://10.0.0.9:7001"),
        None,
    ),
    "flat, eight fields (Megatron-LM 02f201a3)": (
        lambda engine: megatron_02f201a3_to_dict("tcp://10.0.0.9:7001", engine),
        None,
    ),
    "nested (dynamo integration, pull-request/6675)": (
        lambda engine: megatron_nested_ready("tcp://10.0.0.9:7001", engine, "prefill"),
        "prefill",
    ),
    "nested with a version": (
        lambda engine: {
            **megatron_nested_ready("tcp://10.0.0.9:7001", engine, "decode"),
            "version": 3,
        },
        "decode",
    ),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_ready_shape_registers(settings: Settings, shape: str) -> None:
    build, role = SHAPES[shape]
    engine = StubEngine()
    payload = build(engine)
    with EngineEventReceiver(engine_id="shaped", settings=settings, labels={"m": "x"}) as rx:
        _, value = _registered_from(rx, payload, settings)
        caps = value["capabilities"]
        assert value["coordinator_address"] == "tcp://10.0.0.9:7001"
        if "nested" in shape or "02f201a3" in shape:
            assert caps == {
                "context_length": 16384,
                "kv_cache_block_size": 64,
                "total_kv_blocks": 2048,
                "max_num_seqs": 32,
                "max_num_batched_tokens": 8192,
                "bos_token_id": 151643,
                "enable_prefix_caching": True,
                "logical_data_parallel_size": 1,
                "prefix_caching_coordinator_policy": None,  # not in these shapes
            }
        else:
            assert caps == json.loads(json.dumps(payload["capabilities"]))
        assert value["labels"] == {"m": "x"} and value.get("role") == role
        assert "role" not in caps and "version" not in value
        assert rx.health().ready == 1 and rx.health().rejected == 0


LAYOUT = make_layout()
ROLE_CASES = {
    # the nested shape's role is the engine's (protocol.py engine_metadata, PR 6675): it wins
    "nested prefill, none given": ("nested", "prefill", None, "prefill"),
    "nested decode, prefill given": ("nested", "decode", "prefill", "decode"),
    "nested aggregated, decode given": ("nested", "aggregated", "decode", None),
    # Megatron's flat shape (InferenceEngineEndpoint.to_dict()) has no role: the one given
    "flat, decode given": ("flat", None, "decode", "decode"),
    "flat, none given": ("flat", None, None, None),
}


@pytest.mark.parametrize("case", sorted(ROLE_CASES))
def test_the_role_comes_from_either_ready_shape_or_the_one_given(
    settings: Settings, case: str
) -> None:
    shape, said, given, stored = ROLE_CASES[case]
    engine = StubEngine()
    payload = (
        megatron_nested_ready("tcp://10.0.0.9:7001", engine, said)
        if shape == "nested"
        else megatron_02f201a3_to_dict("tcp://10.0.0.9:7001", engine)
    )
    with EngineEventReceiver(
        engine_id="role",
        role=given,
        kv_transfer_backend="nixl",
        kv_layout=LAYOUT,
        settings=settings,
    ) as rx:
        registration, value = _registered_from(rx, payload, settings)
    assert value.get("role") == stored  # aggregated is the absent role
    assert registration.record.role == (stored or "aggregated")
    assert value["kv_transfer_backend"] == "nixl" and value["kv_layout"] == LAYOUT.to_dict()


def test_a_receiver_refuses_a_role_or_backend_it_does_not_know() -> None:
    with pytest.raises(InvalidRecordError, match="role 'encode' is not one of aggregated"):
        EngineEventReceiver(role="encode", state_address=False)
    with pytest.raises(InvalidRecordError, match="kv_transfer_backend 'ucx' is not one of nixl"):
        EngineEventReceiver(kv_transfer_backend="ucx", state_address=False)


def test_the_stand_in_plays_a_role_as_megatron_advertises_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    engine = StubEngine()
    endpoint = default_endpoint(
        "tcp://10.0.0.9:7001",
        context_length=16384,
        kv_cache_block_size=64,
        total_kv_blocks=2048,
        max_num_seqs=32,
        bos_token_id=151643,
    )
    for role in ("aggregated", "prefill", "decode"):
        ours = nested_ready(endpoint, role)
        megatron = megatron_nested_ready("tcp://10.0.0.9:7001", engine, role)
        assert list(ours["engine"].items()) == list(megatron["engine"].items())  # order too
        assert ours == megatron
    with pytest.raises(SystemExit):
        stand_in_main(["--dynamo-parent-event-address", "tcp://x:1", "--role", "decode",
                       "--ready-shape", "flat"])  # fmt: skip
    assert "Megatron's flat ready shape carries no role" in capsys.readouterr().err


def test_a_nested_ready_keeps_keys_it_does_not_know(settings: Settings) -> None:
    payload = megatron_nested_ready("tcp://10.0.0.9:7001", StubEngine(), "prefill")
    payload["engine"]["kv_dtype"] = "fp8"  # a newer Megatron's field
    payload["topology"] = {"tp": 8}
    with EngineEventReceiver(engine_id="newer", settings=settings) as rx:
        _, value = _registered_from(rx, payload, settings)
        assert value["capabilities"]["kv_dtype"] == "fp8"
        assert value["topology"] == {"tp": 8}


def test_a_fixed_event_address_is_bound_and_a_busy_port_is_a_clear_error(
    settings: Settings,
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    with EngineEventReceiver(address=address, settings=settings, engine_id="fixed") as rx:
        assert rx.address == address
        sender = RankZero(address)
        try:
            sender.send("ready", megatron_to_dict())
            rx.wait_registered(timeout=10)
        finally:
            sender.close()
        with pytest.raises(
            ConfigurationError, match=f"cannot bind .* on {address}: the port is in"
        ):
            EngineEventReceiver(address=address, settings=settings).start()
    for bad in ("127.0.0.1:5557", "tcp://127.0.0.1", "tcp://:5557", "tcp://h:70000"):
        with pytest.raises(ConfigurationError, match="must be tcp://HOST:PORT"):
            EngineEventReceiver(address=bad, settings=settings)
    with pytest.raises(ConfigurationError, match="not both"):
        EngineEventReceiver(address=address, host="127.0.0.1", settings=settings)


# -- hung engines ---------------------------------------------------------------------------


def _status(settings: Settings, key: str) -> str | None:
    kv = get_kv(settings.endpoints, key)
    return None if kv is None else json.loads(kv["value"])["status"]


def test_a_silent_engine_that_sent_progress_is_stalled_then_ready_again(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="discovery")
    with EngineEventReceiver(engine_id="hung", settings=settings, stall_timeout=1.0) as rx:
        sender = RankZero(rx.address)
        try:
            sender.send("ready", megatron_to_dict())
            registration = rx.wait_registered(timeout=10)
            # Silence starts when the receiver hears the frame, after this and before
            # wait_for sees it counted: timed from here, never earlier than S.
            silent_from = time.monotonic()
            sender.send("progress", {})
            wait_for(lambda: rx.health().progress == 1, message="the progress frame")
            wait_for(lambda: _status(settings, registration.key) == "stalled", timeout=5)
            assert 1.0 <= time.monotonic() - silent_from < 2.0  # within S + 1 s
            assert rx.state is ReceiverState.STALLED and rx.health().stalls == 1
            sender.send("progress", {})
            heard = time.monotonic()
            wait_for(lambda: _status(settings, registration.key) == "ready", timeout=5)
            assert time.monotonic() - heard < 1.0
            assert rx.state is ReceiverState.REGISTERED
        finally:
            sender.close()
    stalls = [r for r in caplog.records if "marking it stalled" in r.getMessage()]
    assert len(stalls) == 1 and stalls[0].levelno == logging.WARNING


def test_an_engine_that_never_sends_progress_is_never_stalled(settings: Settings) -> None:
    with EngineEventReceiver(engine_id="quiet", settings=settings, stall_timeout=0.5) as rx:
        sender = RankZero(rx.address)
        try:
            sender.send("ready", megatron_to_dict())
            registration = rx.wait_registered(timeout=10)
            sender.send("stored", {"block_hashes": [1, 2]})
            wait_for(lambda: rx.health().silence > 2.0, message="four stall timeouts of silence")
            assert _status(settings, registration.key) == "ready"
            assert rx.health().stalls == 0 and rx.state is ReceiverState.REGISTERED
        finally:
            sender.close()


def test_silence_while_draining_is_no_stall(settings: Settings) -> None:
    with EngineEventReceiver(engine_id="resting", settings=settings, stall_timeout=1.0) as rx:
        sender = RankZero(rx.address)
        try:
            sender.send("ready", megatron_to_dict())
            registration = rx.wait_registered(timeout=10)
            sender.send("progress", {})
            wait_for(lambda: rx.health().progress == 1, message="the progress frame")
            drain("resting", settings=settings)  # an operator drains it
            wait_for(lambda: registration.status is EngineStatus.DRAINING, message="adopted")
            wait_for(lambda: rx.health().silence > 3.0, message="three stall timeouts")
            assert _status(settings, registration.key) == "draining"
            undrain("resting", settings=settings)
            ready_at = time.monotonic()
            wait_for(lambda: registration.status is EngineStatus.READY, message="undrained")
            # Silence counts from the return to ready: a stall one timeout later, not at once.
            wait_for(lambda: _status(settings, registration.key) == "stalled", timeout=5)
            assert time.monotonic() - ready_at >= 0.9
        finally:
            sender.close()
