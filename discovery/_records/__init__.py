"""The record: what an engine is and how it is stored.

Megatron's endpoint, our stored record, label selectors, hand-off compatibility, the key layout
and the codec. No I/O.
"""
