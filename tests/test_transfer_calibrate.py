"""The kernel/DMA cut-off rule (the GPU measurement itself runs in gpu/worker_check.py)."""

from __future__ import annotations

from kvcache.transfer._calibrate import KiB, choose_cutoff, measure


def test_cutoff_is_the_largest_size_up_to_which_the_kernel_always_won() -> None:
    assert choose_cutoff([(4 * KiB, 20.0, 6.0), (8 * KiB, 30.0, 12.0), (16 * KiB, 35.0, 40.0)]) == (
        8 * KiB
    )
    # A later win after a loss does not count: the rule is a prefix.
    assert choose_cutoff([(4 * KiB, 9.0, 6.0), (8 * KiB, 9.0, 12.0), (16 * KiB, 50.0, 40.0)]) == (
        4 * KiB
    )
    assert choose_cutoff([(4 * KiB, 5.0, 6.0)]) == 0  # DMA everywhere
    assert choose_cutoff([(4 * KiB, 7.0, 6.0), (128 * KiB, 60.0, 50.0)]) == 128 * KiB
    assert choose_cutoff([]) == 0


def test_measure_times_both_methods_at_every_size() -> None:
    calls: list[tuple[str, int]] = []

    def fake(method: str, page: int) -> float:
        calls.append((method, page))
        return page / KiB if method == "kernel" else 16.0

    table = measure(fake, [4 * KiB, 16 * KiB, 32 * KiB])
    assert table == [(4 * KiB, 4.0, 16.0), (16 * KiB, 16.0, 16.0), (32 * KiB, 32.0, 16.0)]
    assert len(calls) == 6
    assert choose_cutoff(table) == 0


def test_measure_stops_at_the_budget_but_keeps_what_it_measured() -> None:
    now = [0.0]

    def fake(method: str, page: int) -> float:
        now[0] += 2.0  # each timed load "takes" two seconds of the start-up budget
        return 10.0 if method == "kernel" else 5.0

    sizes = [4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB]
    table = measure(fake, sizes, budget_s=5.0, clock=lambda: now[0])
    assert [p for p, _k, _d in table] == [4 * KiB, 8 * KiB]
    assert choose_cutoff(table) == 8 * KiB
    # Without a budget every size is measured.
    assert len(measure(fake, sizes)) == 4
