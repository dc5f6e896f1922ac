"""``discovery.testing.stand_in_engine``, importable from its old path too."""

from discovery.testing.stand_in_engine import *  # noqa: F403
from discovery.testing.stand_in_engine import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
