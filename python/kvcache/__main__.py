"""``python -m kvcache ...``: the same entry point as the ``kvcache`` console script."""

from kvcache.cli import main

raise SystemExit(main())
