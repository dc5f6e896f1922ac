"""``discovery.testing.stand_in_coordinator``, importable from its old path too."""

from discovery.testing.stand_in_coordinator import *  # noqa: F403
from discovery.testing.stand_in_coordinator import __all__  # noqa: F401
