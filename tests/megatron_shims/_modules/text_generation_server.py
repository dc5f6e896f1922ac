"""SHIM (tests only) for ``megatron/core/inference/text_generation_server/__init__.py``,
which imports the legacy Flask server: the package over Megatron's own directory, so
``dynamic_text_gen_server`` (Megatron's Quart server) imports as it is."""
