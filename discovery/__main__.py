"""``python -m discovery``: the same as the ``discovery`` command."""

from ._cli import main

raise SystemExit(main())
