"""EngineEventReceiver fed by a rank zero that sends Megatron's frames, registering on the
memory port and on real etcd (``store``)."""

from __future__ import annotations

import asyncio
import enum
import json
import logging

import msgpack
import pytest
import zmq

from discovery import (
    ClosedError,
    ConfigurationError,
    EngineConflictError,
    EngineEventReceiver,
    InvalidRecordError,
    ReceiverState,
    register_engine,
)
from discovery._events import decode_frame, endpoint_from_ready

from .conftest import Store
from .helpers import MEGATRON_FIELDS, WatchLog, caps_kwargs, make_endpoint, wait_for


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


class RankZero:
    """Megatron's side of the socket, as its EngineEventReporter sets it up and sends."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, kind: str, payload: object) -> None:
        self.sock.send(msgpack.packb([kind, payload], use_bin_type=True))

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def close(self) -> None:
        self.sock.close()
        self.context.term()


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
    metadata = {k: value.pop(k) for k in ("engine_id", "labels", "registered_at", "status")}
    assert value == json.loads(json.dumps(payload))  # Megatron's to_dict(), unchanged
    assert metadata["engine_id"] == "rz-0" and metadata["labels"] == {"model": "m"}
    assert metadata["status"] == "ready"
    _frames_seen(receiver, 3)
    health = receiver.health()
    assert (health.frames, health.ready, health.ignored, health.malformed, health.rejected) == (
        3,
        1,
        2,
        0,
        0,
    )
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
    rank_zero.send("a-kind-from-the-future", None)
    caps = megatron_to_dict()["capabilities"]
    rejected = [
        "not a map",
        {**caps, "role": "prefill"},  # Megatron's engine_metadata(): capabilities with a role
        caps,  # bare capabilities
        {"something": "else"},
        {"coordinator_address": "tcp://x:1", "capabilities": {"context_length": 1}},
        megatron_to_dict(context_length=0),
        megatron_to_dict(prefix_caching_coordinator_policy="nearest"),
        {**megatron_to_dict(), "role": 7},
        {**megatron_to_dict(), "role": "x" * 300},  # a role label must fit
    ]
    for payload in rejected:
        rank_zero.send("ready", payload)
    total = len(malformed) + 2 + len(rejected)
    _frames_seen(receiver, total)
    health = receiver.health()
    assert (health.malformed, health.ignored, health.rejected, health.ready) == (5, 2, 9, 0)
    assert health.state is ReceiverState.WAITING
    assert store.get(store.settings.keyspace.key("rz-0")) is None
    log = caplog.text
    assert "not msgpack (FormatError" in log and "not a [kind, payload] pair" in log
    assert "Megatron's engine metadata (capabilities with a role" in log
    assert "bare capabilities (InferenceEngineCapabilities.to_dict())" in log
    assert "(endpoint shape) is missing field 'kv_cache_block_size'" in log
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
        assert dict(updated.labels) == {"model": "m", "role": "decode"}
        second = store.get(registration.key)
        assert second.lease == first.lease  # same lease: one put, never absent
        assert second.mod_revision == updated.revision
        assert changes.kinds("rz-0") == ["added", "updated"]  # the repeat wrote nothing
        assert receiver.health().ready == 3
    finally:
        changes.stop()


def test_a_role_from_the_ready_payload_becomes_the_role_label(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    with EngineEventReceiver(
        engine_id="roled", labels={"role": "decode"}, **store.using()
    ) as receiver:
        sender = RankZero(receiver.address)
        try:
            sender.send("ready", {**megatron_to_dict(), "role": "prefill"})
            registration = receiver.wait_registered(timeout=10)
        finally:
            sender.close()
        assert dict(registration.record.labels) == {"role": "prefill"}
        value = json.loads(store.get(registration.key).value)
        assert "role" not in value and value["labels"] == {"role": "prefill"}
    assert "the engine says role 'prefill'; it replaces the role label 'decode'" in caplog.text


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
    endpoint, role = endpoint_from_ready(megatron_to_dict())
    assert endpoint.to_dict() == megatron_to_dict() and role is None
    with pytest.raises(InvalidRecordError, match="is a list, not a map"):
        endpoint_from_ready([])
    with pytest.raises(InvalidRecordError, match="its keys: \\['a', 'b'\\]"):
        endpoint_from_ready({"b": 1, "a": 2})
