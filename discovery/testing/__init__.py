"""Test support: etcd in memory, embedded clusters, the stand-in engine.

Public modules for tests, benchmarks and the demo; the library never imports them.
"""
