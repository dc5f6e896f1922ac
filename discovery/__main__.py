"""``python -m discovery``: the same as the ``discovery`` command."""

from .cli import main

raise SystemExit(main())
