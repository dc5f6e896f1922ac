"""What engines report beyond etcd: their cached blocks and load.

Megatron's block hashes, KV block sets, the engine's state relay and the routers' EngineStates
that follow it.
"""
