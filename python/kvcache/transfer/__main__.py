"""``python -m kvcache.transfer bench``: the same as ``kvcache transfer bench``."""

import sys

from kvcache.cli import main

sys.exit(main(["transfer", *sys.argv[1:]]))
