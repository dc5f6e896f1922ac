"""What an operator does to a live engine from outside its process.

``drain`` / ``undrain`` / ``pause`` / ``resume`` rewrite the record's ``status`` (and
``resume`` its ``weight_version``) in place: on the same lease, with a compare on the
revision they read (a concurrent change is read again, never overwritten; the version
rule, never lowered without ``force``, is checked against that same read). The engine's
registrar sees the change on its own watch, adopts it, never writes it back (also when it
writes the record again after a lost lease), and revokes at the drain deadline.
``deregister`` removes the record: it revokes the lease when the lease holds only that
key, and deletes the key alone when
other engines share the lease (a ``Session``), so that one operator action never takes
down a whole session. A live registrar writes a deregistered record again (that is its
self-healing): stop the engine to remove it for good, or drain it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from discovery._errors import RecordDecodeError
from discovery._etcd.port import EtcdPort, KeyValue
from discovery._etcd.transport import keyspace_for, port_for
from discovery._records.codec import KeySpace, encode
from discovery._records.record import (
    EngineRecord,
    EngineStatus,
    check_version_order,
    drain_deadline_after,
    validate_weight_version,
)
from discovery._settings import Settings

__all__ = ["deregister", "drain", "pause", "resume", "undrain"]

log = logging.getLogger(__name__)


def deregister(
    engine_id: str,
    settings: Settings | None = None,
    *,
    connection: EtcdPort | None = None,
) -> int | None:
    """Remove an engine's record from outside its process (an operator's action).

    Revokes the lease the record is bound to when that lease holds no other key, else
    deletes this key only (a lease shared by a ``Session``'s engines stays). Returns the
    revoked lease id; 0 when no lease was revoked (the key had none, or shared one); None
    when no such engine is registered. A live registrar writes its record again (that is
    its self-healing): stop the engine to remove it for good. Uses ``connection`` if
    given, else one built from ``settings``.
    """
    keyspace = keyspace_for(settings, connection)
    key = keyspace.key(engine_id)
    with port_for(connection, settings) as conn:
        found = conn.call(lambda: conn.get(key))
        if found is None:
            return None
        _announce_stopping(conn, keyspace, key, found)
        lease = found.lease
        if not lease:
            conn.call(lambda: conn.delete(key))
            return 0
        shared = [k for k in conn.call(lambda: conn.lease_info(lease)).keys if k != found.key]
        if shared:
            conn.call(lambda: conn.delete_owned(key, lease))
            log.info("deleted %s only: lease %016x holds %d other keys", key, lease, len(shared))
            return 0
        conn.call(lambda: conn.revoke(lease))
        return lease


def _announce_stopping(conn: EtcdPort, keyspace: KeySpace, key: str, found: KeyValue) -> None:
    """Mark a ready record ``stopping`` before removing it: routers see a deliberate removal.

    Best effort: a value that does not decode, or a record changed meanwhile, is removed
    unannounced.
    """
    try:
        record = keyspace.decode(found.key, found.value)
    except RecordDecodeError:
        return
    if record.status is not EngineStatus.READY:
        return
    value = encode(replace(record, status=EngineStatus.STOPPING))
    conn.call(partial(conn.update, key, value, found.lease, mod_revision=found.mod_revision))


def drain(
    engine_id: str,
    timeout: float | None = None,
    settings: Settings | None = None,
    *,
    connection: EtcdPort | None = None,
) -> EngineRecord | None:
    """Mark a live engine ``draining``: routers stop picking it, its requests finish.

    With ``timeout``, the record carries ``drain_deadline`` = now + ``timeout`` and the
    engine's registrar revokes its lease then; without, the engine stays registered and
    draining until ``undrain`` (maintenance). Returns the record as written (unchanged if
    it was already so), or None when no such engine is registered. Raises
    RecordDecodeError when the stored value does not decode.
    """
    deadline = None if timeout is None else drain_deadline_after(timeout)
    return _rewrite(
        engine_id,
        lambda record: replace(record, status=EngineStatus.DRAINING, drain_deadline=deadline),
        settings,
        connection,
    )


def undrain(
    engine_id: str,
    settings: Settings | None = None,
    *,
    connection: EtcdPort | None = None,
) -> EngineRecord | None:
    """Put a ``draining`` engine back to ``ready`` (its drain deadline is cancelled).

    A ``ready`` or ``starting`` engine is left as it is. Returns the record as it is
    now, or None when no such engine is registered.
    """
    return _rewrite(
        engine_id,
        lambda record: (
            replace(record, status=EngineStatus.READY, drain_deadline=None)
            if record.status is EngineStatus.DRAINING
            else record
        ),
        settings,
        connection,
    )


def pause(
    engine_id: str,
    settings: Settings | None = None,
    *,
    connection: EtcdPort | None = None,
) -> EngineRecord | None:
    """Mark a live engine ``paused``: routers stop picking it; it keeps its lease and id.

    For a weight update (a trainer's refit) or memory suspended for training; requests
    already picked finish. A ``ready`` or ``starting`` engine is paused; a ``draining`` one
    is left as it is (it takes nothing new already, and leaves at its deadline). Returns
    the record as it is now, or None when no such engine is registered.
    """
    return _rewrite(
        engine_id,
        lambda record: (
            replace(record, status=EngineStatus.PAUSED)
            if record.status in (EngineStatus.READY, EngineStatus.STARTING)
            else record
        ),
        settings,
        connection,
    )


def resume(
    engine_id: str,
    weight_version: int | None = None,
    settings: Settings | None = None,
    *,
    force: bool = False,
    connection: EtcdPort | None = None,
) -> EngineRecord | None:
    """Put a ``paused`` engine back to ``ready``, on ``weight_version`` if given: one write.

    A refit is ``pause(engine_id)``, the new weights loaded, then ``resume(engine_id,
    new_version)``: no reader ever sees the engine ready on the old version after that.
    A ``ready`` engine takes the version (also one write); a ``starting`` or ``draining``
    one is left as it is. A version lower than the stored one raises InvalidRecordError
    naming both, unless ``force`` (a rollback); the check is made on the value the
    compare-and-swap compares, so a concurrent higher version is never overwritten.
    Returns the record as it is now, or None when no such engine is registered.
    """
    version = validate_weight_version(weight_version)

    def change(record: EngineRecord) -> EngineRecord:
        if record.status not in (EngineStatus.PAUSED, EngineStatus.READY):
            return record
        if version is None:
            return replace(record, status=EngineStatus.READY)
        check_version_order(record.weight_version, version, force=force)
        return replace(record, status=EngineStatus.READY, weight_version=version)

    return _rewrite(engine_id, change, settings, connection)


def set_weight_version(
    engine_id: str,
    weight_version: int,
    settings: Settings | None = None,
    *,
    connection: EtcdPort | None = None,
) -> EngineRecord | None:
    """Write a live engine's ``weight_version``, its status left as it is (never backwards).

    What the fleet client writes after Megatron's SET_GENERATION_EPOCH: a paused engine
    stays paused. Returns the record as it is now, or None when no such engine is registered.
    """
    version = validate_weight_version(weight_version)

    def change(record: EngineRecord) -> EngineRecord:
        check_version_order(record.weight_version, version, force=False)
        return replace(record, weight_version=version)

    return _rewrite(engine_id, change, settings, connection)


def _rewrite(
    engine_id: str,
    change: Callable[[EngineRecord], EngineRecord],
    settings: Settings | None,
    connection: EtcdPort | None,
) -> EngineRecord | None:
    """Apply ``change`` to the stored record, on its lease, by compare-and-swap."""
    keyspace = keyspace_for(settings, connection)
    key = keyspace.key(engine_id)
    with port_for(connection, settings) as conn:
        while True:
            found = conn.call(lambda: conn.get(key))
            if found is None:
                return None
            record = keyspace.decode(found.key, found.value)
            new = change(record)
            if new == record:
                return record
            write = partial(
                conn.update, key, encode(new), found.lease, mod_revision=found.mod_revision
            )
            result = conn.call(write)
            if result.succeeded:
                log.info(
                    "%s: status %s -> %s, weight_version %s -> %s",
                    engine_id,
                    record.status,
                    new.status,
                    record.weight_version,
                    new.weight_version,
                )
                return new
            # Changed between the read and the write (its registrar, another operator).
