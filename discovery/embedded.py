"""``discovery.testing.embedded``, importable from its old path too."""

from discovery.testing.embedded import *  # noqa: F403
from discovery.testing.embedded import __all__  # noqa: F401
