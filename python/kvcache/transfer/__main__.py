"""``python -m kvcache.transfer bench``: see ``kvcache.transfer._bench``."""

import sys

from kvcache.transfer._bench import main

sys.exit(main())
