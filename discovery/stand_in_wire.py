"""``discovery.testing.stand_in_wire``, importable from its old path too."""

from discovery.testing.stand_in_wire import *  # noqa: F403
from discovery.testing.stand_in_wire import __all__  # noqa: F401
