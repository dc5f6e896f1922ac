"""Size budgets without etcd (issue 43.2): batches split by bytes, a change over the
request limit refused before it is sent (real etcd: tests/test_etcd_limits.py)."""

from __future__ import annotations

import json

import pytest

from discovery import RequestTooLargeError, register_engine
from discovery._etcd.port import MAX_BATCH, REQUEST_OVERHEAD, batches, write_bytes
from discovery.testing.memory import MemoryPort

from .helpers import make_endpoint


def test_batches_stay_under_the_byte_limit_and_max_batch() -> None:
    limit = 10_000 + REQUEST_OVERHEAD
    runs = list(batches([3000] * 7, lambda size: size, limit))
    assert [len(run) for run in runs] == [3, 3, 1]  # 3 x 3000 fit in 10,000, a 4th not
    assert [len(run) for run in batches([1] * 250, lambda size: size, limit)] == [
        MAX_BATCH,
        MAX_BATCH,
        50,
    ]
    # One item over the limit goes alone (for etcd to refuse that one), the rest around it.
    assert list(batches([100, 20_000, 100], lambda size: size, limit)) == [[100], [20_000], [100]]


def test_write_bytes_counts_the_key_thrice() -> None:
    assert write_bytes("/k", b"v" * 10) - write_bytes("/", b"v" * 10) == 3


def test_an_update_over_the_request_limit_is_refused_before_it_is_sent() -> None:
    with (
        MemoryPort(max_request_bytes=8192) as port,
        register_engine(make_endpoint(), engine_id="e1", labels={"a": "1"}, connection=port) as reg,
    ):
        revision = port.get(reg.key).mod_revision  # type: ignore[union-attr]
        big = {f"k{i:02d}": "v" * 190 for i in range(60)}
        with pytest.raises(RequestTooLargeError, match="not sent") as caught:
            reg.update(labels=big)
        assert caught.value.limit == 8192 and caught.value.size > 8192
        assert "shorten the record's labels" in str(caught.value)
        assert reg.record.labels == {"a": "1"}
        stored = port.get(reg.key)
        assert stored is not None and stored.mod_revision == revision  # nothing written
        assert json.loads(stored.value)["labels"] == {"a": "1"}
