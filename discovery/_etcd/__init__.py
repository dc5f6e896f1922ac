"""etcd: the port, its one adapter and the one list-watch loop.

Only connection.py imports python3-etcd3; only transport.py builds it.
"""
