"""What a progress bar costs inside a timed replay: tqdm (used) vs rich (considered).

The replay driver calls the progress callback ~50 times per replay inside the timed loop, so a
redraw lands in the measured ns/visit. Prints microseconds per call, with and without a redraw.

    python bench/progress_cost.py
"""

from __future__ import annotations

import io
import time

N = 20_000


def per_call_us(fn: object, n: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(n):
        fn()  # type: ignore[operator]
    return (time.perf_counter_ns() - start) / n / 1000


def main() -> None:
    from tqdm import tqdm

    bar = tqdm(total=N, file=io.StringIO(), mininterval=0.0, miniters=1, ncols=100)
    print(f"tqdm, redraw every call:  {per_call_us(lambda: bar.update(1), N):8.2f} us")
    bar.close()
    bar = tqdm(total=N, file=io.StringIO(), mininterval=0.5)
    print(f"tqdm, mininterval 0.5 s:  {per_call_us(lambda: bar.update(1), N):8.2f} us")
    bar.close()
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:
        print("rich: not installed")
        return
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeRemainingColumn(),
        console=console,
        auto_refresh=False,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    progress.start()
    task = progress.add_task("run", total=N)

    def redraw() -> None:
        progress.update(task, advance=1)
        progress.refresh()

    print(f"rich, redraw every call:  {per_call_us(redraw, 2_000):8.2f} us")
    quiet = per_call_us(lambda: progress.update(task, advance=1), N)
    print(f"rich, no redraw:          {quiet:8.2f} us")
    progress.stop()


if __name__ == "__main__":
    main()
