"""``discovery.testing.embedded_netns``, importable from its old path too."""

from discovery.testing.embedded_netns import *  # noqa: F403
from discovery.testing.embedded_netns import __all__  # noqa: F401
