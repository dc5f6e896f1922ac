"""The engine side: Megatron's engine events, launch and its guard.

Runs beside (or around) a Megatron engine; feeds the write side and the state relay.
"""
