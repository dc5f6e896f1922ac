"""``python -m discovery``: the same as the ``discovery`` command."""

from discovery.cli import main

raise SystemExit(main())
