"""What ``discovery serve`` is asked for, and what it needs: ``ServeOptions``, ``missing``.

The options travel to each replica process as JSON (``to_json`` / ``from_json``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass

__all__ = ["MEGATRON_SERVER", "ServeOptions", "missing"]

MEGATRON_SERVER = "megatron.core.inference.text_generation_server.dynamic_text_gen_server"
"""Megatron's OpenAI-compatible server (its endpoints), from the user's megatron-core."""


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """``discovery serve``'s options (the CLI's flags; ``serve_fleet``'s arguments)."""

    fleet: str
    tokenizer: str
    tokenizer_library: str = "huggingface"
    host: str = "0.0.0.0"
    port: int = 5000
    replicas: int = 4
    parsers: tuple[str, ...] = ()
    chat_template: str | None = None
    verbose: bool = False
    grace: float = 30.0
    retry_after: int = 1

    def to_json(self) -> str:
        """The options as one JSON string (a replica's argument)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServeOptions:
        """The options ``to_json`` wrote."""
        values = json.loads(text)
        values["parsers"] = tuple(values["parsers"])
        return cls(**values)


def missing() -> str | None:
    """What ``discovery serve`` cannot import here, and how to install it (None: nothing)."""
    absent = []
    if _absent(MEGATRON_SERVER):
        absent.append("megatron-core (Megatron's server, client and tokenizers)")
    extra = [name for name in ("quart", "hypercorn", "zmq", "msgpack") if _absent(name)]
    if extra:
        absent.append(f"the discovery[serve] extra ({', '.join(extra)})")
    if not absent:
        return None
    return (
        f"{' and '.join(absent)}, which cannot be imported here: "
        "pip install megatron-core 'discovery[serve]'"
    )


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package is missing
        return True
