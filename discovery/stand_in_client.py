"""``discovery.testing.stand_in_client``, importable from its old path too."""

from discovery.testing.stand_in_client import *  # noqa: F403
from discovery.testing.stand_in_client import __all__  # noqa: F401
