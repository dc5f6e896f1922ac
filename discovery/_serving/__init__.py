"""Serving: Megatron's own OpenAI-compatible server over the whole fleet (``discovery serve``)."""
