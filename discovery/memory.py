"""``discovery.testing.memory``, importable from its old path too."""

from discovery.testing.memory import *  # noqa: F403
from discovery.testing.memory import __all__  # noqa: F401
