"""SHIM (tests only) for ``megatron/core/__init__.py``, which imports the training stack.

The package spans this directory (the shims) and Megatron's own ``megatron/core`` further
on ``sys.path``, so ``megatron.core.inference`` is Megatron's. The modules Megatron's
files cannot import here are installed from ``_modules/`` under their own names.
"""

import importlib.util
import pkgutil
import sys
from pathlib import Path

__path__ = pkgutil.extend_path(__path__, __name__)  # noqa: F821 - a package's own name

_MODULES = Path(__file__).resolve().parent.parent.parent / "_modules"


def _package_path(*parts: str) -> list[str]:
    """Megatron's directories for package ``megatron.core.<parts>`` (on the path)."""
    return [str(Path(p, *parts)) for p in __path__ if Path(p, *parts).is_dir()]


def _install(name: str, file: str, package: tuple[str, ...] | None = None) -> None:
    """Load ``_modules/<file>`` as module ``name`` (a package over ``package``'s dirs)."""
    if name in sys.modules:
        return
    locations = None if package is None else _package_path(*package)
    spec = importlib.util.spec_from_file_location(
        name, _MODULES / file, submodule_search_locations=locations
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_install("megatron.core.tokenizers", "tokenizers.py", ("tokenizers",))
_install("megatron.core.tokenizers.text", "tokenizers_text.py", ("tokenizers", "text"))
_install("megatron.core.inference.config", "inference_config.py")
_install(
    "megatron.core.inference.text_generation_server",
    "text_generation_server.py",
    ("inference", "text_generation_server"),
)
