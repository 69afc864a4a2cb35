"""A closed host chunk pool, used anyway: each case runs in a fresh interpreter, and every call
that would act on the pool's memory must raise ``PoolClosedError`` (an ``InvalidStateError``):
exporting it, building a pool, a layout or an engine over it, prefaulting it. Before, a pool
built over a closed pool raised ``InvalidTypeError`` ("buffer must export bytes"), a pool over
a pool closed later went on exporting zero pages as open, and ``populate`` on a closed pool
faulted back in the pages ``close()`` had given up.

A pool over another pool's memory (``buffer=pool``, or a memoryview or numpy array over one)
is closed as soon as that pool is, and that pool's ``close()`` waits (``TransferError``, as
for its own transfers) while a plan over the inner pool is alive.
"""

from __future__ import annotations

import pytest

from tests.support import no_oracle
from tests.support.hostile import run_isolated

SCRIPT = """
import numpy as np
import kvcache
from kvcache import _core
from kvcache.transfer import HostChunkPool

LAYER = (1 << 40, 4096, 4096, 4, 0)  # a device layer: base, block stride, page, blocks, segment

def outcome(call):
    try:
        call()
        return "returned"
    except BaseException as exc:
        return type(exc).__name__

{setup}

calls = {
    "memoryview": lambda: memoryview(pool),
    "numpy": lambda: np.frombuffer(pool, dtype=np.uint8),
    "tensor": lambda: pool.tensor(),
    "populate": lambda: pool.populate(1),
    "pool-over-it": lambda: HostChunkPool(1, 4096, pin=False, buffer=pool),
    "core-pool-over-it": lambda: _core.HostChunkPool(1, 4096, buffer=pool),
    "layout-over-it": lambda: _core.TransferLayout(pool, [LAYER], 1),
}
results = {name: outcome(call) for name, call in calls.items()}
report(closed=pool.closed, resident=pool.resident_bytes(), **results)
"""

SETUPS = [
    ("closed", "pool = HostChunkPool(4, 4096, pin=False)\npool.close()"),
    (
        "over-a-pool-closed-later",
        "outer = HostChunkPool(4, 4096, pin=False)\n"
        "pool = HostChunkPool(2, 4096, pin=False, buffer=outer)\n"
        "outer.close()",
    ),
    (
        "over-a-memoryview-of-a-pool-closed-later",
        "outer = HostChunkPool(4, 4096, pin=False)\n"
        "pool = HostChunkPool(2, 4096, pin=False, buffer=memoryview(outer))\n"
        "outer.close()",
    ),
    (
        "over-a-numpy-view-of-a-pool-closed-later",
        "outer = HostChunkPool(4, 4096, pin=False)\n"
        "pool = HostChunkPool(2, 4096, pin=False, buffer=np.frombuffer(outer, np.uint8)[:8192])\n"
        "outer.close()",
    ),
    (
        "inner-pool-closed",
        "outer = HostChunkPool(4, 4096, pin=False)\n"
        "pool = HostChunkPool(2, 4096, pin=False, buffer=outer)\n"
        "pool.close()\n"
        "assert not outer.closed and len(memoryview(outer)) == 4 * 4096",
    ),
]


@pytest.mark.parametrize("setup", [s[1] for s in SETUPS], ids=[s[0] for s in SETUPS])
def test_every_use_of_a_closed_pool_raises_pool_closed(setup: str) -> None:
    no_oracle.needs("torch")  # the child process imports it
    report = run_isolated(SCRIPT.replace("{setup}", setup)).check()
    assert report.pop("closed") is True, report
    assert report.pop("resident") == 0, report  # a status: it still answers
    del report["vm_peak"], report["rss_peak"]
    assert report == dict.fromkeys(report, "PoolClosedError"), report


WAITS = """
from kvcache import _core
from kvcache.transfer import HostChunkPool

outer = HostChunkPool(4, 4096, pin=False)
inner = HostChunkPool(2, 4096, pin=False, buffer=outer)
layout = _core.TransferLayout(inner, [(1 << 40, 4096, 4096, 4, 0)], 1)
plan = layout.plan(True, [0], [1])  # holds a lease on the inner pool until dropped
try:
    outer.close()
    while_planned = "closed"
except BaseException as exc:
    while_planned = type(exc).__name__
del plan
outer.close()
report(while_planned=while_planned, after=outer.closed, inner=inner.closed)
"""


def test_a_pool_waits_for_transfers_over_a_pool_inside_it() -> None:
    report = run_isolated(WAITS).check()
    assert report["while_planned"] == "TransferError", report
    assert report["after"] is True, report
    assert report["inner"] is True, report


VIEWS_TAKEN_BEFORE_CLOSE = """
import numpy as np
from kvcache.transfer import HostChunkPool

def outcome(call):
    try:
        return "returned a pool, closed=%s" % call().closed
    except BaseException as exc:
        return type(exc).__name__

outer = HostChunkPool(4, 4096, pin=False)
inner = HostChunkPool(2, 4096, pin=False, buffer=outer)
views = {
    "memoryview": memoryview(outer),
    "memoryview-slice": memoryview(outer)[4096:8192],
    "numpy": np.frombuffer(outer, dtype=np.uint8),
    "numpy-of-a-memoryview": np.asarray(memoryview(outer))[:4096],
    "view-of-an-inner-pool": memoryview(inner),
}
outer.close()
report(**{name: outcome(lambda v=v: HostChunkPool(1, 4096, pin=False, buffer=v))
          for name, v in views.items()})
"""


def test_a_view_taken_before_its_pool_closed_builds_no_pool() -> None:
    """A memoryview or numpy array taken while the pool was open still exports its memory
    after ``close()``; a pool built over it would be closed from birth, so it is refused with
    ``PoolClosedError`` like a pool over the closed pool itself."""
    no_oracle.needs("torch")  # the child process imports it
    report = run_isolated(VIEWS_TAKEN_BEFORE_CLOSE).check()
    del report["vm_peak"], report["rss_peak"]
    assert report == dict.fromkeys(report, "PoolClosedError"), report
    assert len(report) == 5, report
