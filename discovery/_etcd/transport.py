"""The one factory of the etcd port, and what the public API resolves from its arguments.

Everything above the adapter is typed against ``EtcdPort`` (``_etcd/port.py``). This module
is the only one (besides the package's re-export of ``Connection``) that imports the
python3-etcd3 adapter: another client would mean another adapter and a change here, and
nothing else.

The public functions take ``settings`` and ``connection`` (any ``EtcdPort``). The
transport carries only how to reach etcd; the key layout (root and namespace) is
resolved here, once, and handed to each component: from ``settings`` when given, else
from the settings a ``Connection`` was built with, else from ``DISCOVERY_*`` variables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from discovery._etcd.connection import Connection
from discovery._etcd.port import EtcdPort
from discovery._metrics import MetricsHooks
from discovery._records.codec import KeySpace
from discovery._settings import Settings

__all__ = ["connect", "keyspace_for", "port_for"]


def connect(settings: Settings | None = None, metrics: MetricsHooks | None = None) -> EtcdPort:
    """The etcd port for ``settings`` (default ``Settings.from_env()``): the adapter.

    ``metrics`` hears which etcd endpoints it knows (it follows the cluster's membership).
    """
    return Connection(settings, metrics=metrics)


def keyspace_for(settings: Settings | None, port: EtcdPort | None) -> KeySpace:
    """The key layout a call works in (see the module docs)."""
    if settings is None:
        settings = port.settings if isinstance(port, Connection) else Settings.from_env()
    return settings.keyspace


@contextlib.contextmanager
def port_for(port: EtcdPort | None, settings: Settings | None) -> Iterator[EtcdPort]:
    """``port`` if given, else a new one from ``settings``, closed when the block ends."""
    if port is not None:
        yield port
        return
    own = connect(settings)
    try:
        yield own
    finally:
        own.close()
