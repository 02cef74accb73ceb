"""Shared timing and table helpers for the benchmark suites (pytest-benchmark + `run_report`)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch


def sync(device: str | torch.device | None = None) -> None:
    """Wait for the device so a timed function measures finished work."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], *, repeat: int = 7, warmup: int = 2, device=None, min_time: float = 0.0) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs (after ``warmup``), synchronizing ``device``.

    Short functions are looped so one sample lasts at least ``min_time`` seconds."""
    for _ in range(warmup):
        fn()
    sync(device)
    inner = 1
    if min_time > 0:
        start = time.perf_counter()
        fn()
        sync(device)
        once = max(time.perf_counter() - start, 1e-9)
        inner = max(1, int(min_time / once))
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def format_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table; floats printed with 3 significant digits."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
        return str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def machine_summary() -> dict:
    import os
    import platform

    info = {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed (plots are optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig, out_dir: str, name: str) -> str:
    import os

    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    fig.clf()
    return path


def line_plot(out_dir: str, name: str, x: Sequence[float], series: dict[str, Sequence[float]], **axes) -> list[str]:
    """One PNG with a line per series over ``x`` (``axes``: xlabel, ylabel, title, xscale...); [] without matplotlib."""
    plt = pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for label, ys in series.items():
        ax.plot(x, ys, marker="o", label=label)
    ax.set(**axes)
    ax.grid(True, alpha=0.3)
    outside_legend(ax)
    return [save(fig, out_dir, name)]


def outside_legend(ax) -> None:
    """The legend to the right of the axes, so it never covers a line or a bar."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def best_seconds(fn: Callable[[], object], *, repeat: int = 50, warmup: int = 5, device=None) -> float:
    """Fastest wall time of ``fn()`` over ``repeat`` single runs (after ``warmup``), synchronizing ``device``.

    For microsecond-scale functions on a shared machine: every run that another process preempts is
    slower, never faster, so the fastest run is the best estimate of the function's own cost."""
    for _ in range(warmup):
        fn()
    sync(device)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def interleaved_median_seconds(fns: dict[str, Callable[[], object]], *, repeat: int = 7, warmup: int = 2, device=None,
                               min_time: float = 0.0) -> dict[str, float]:
    """Median wall time of each ``fns[name]()``, sampled round-robin: each round takes one sample of every
    function, so a busy neighbour on a shared machine slows every contender alike rather than whichever
    happened to run at the time. Short functions are looped so one sample lasts ``min_time`` seconds."""
    inner = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        inner[name] = max(1, int(min_time / max(time.perf_counter() - start, 1e-9))) if min_time > 0 else 1
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner[name]):
                fn()
            sync(device)
            samples[name].append((time.perf_counter() - start) / inner[name])
    return {name: statistics.median(values) for name, values in samples.items()}


def cpu_us_per_call(fn: Callable[[], object], *, rounds: int = 7, min_time: float = 0.2) -> list[float]:
    """CPU microseconds of the calling thread per ``fn()`` call, one figure per round (each round loops
    for >= ``min_time`` s of thread CPU time). Thread CPU time, not wall time: on a shared host the
    time this thread spends descheduled would otherwise swamp a per-call overhead of microseconds.
    Only for single-threaded calls (work done on other threads is not counted)."""
    for _ in range(200):
        fn()
    samples = []
    for _ in range(rounds):
        calls, start = 0, time.thread_time()
        while time.thread_time() - start < min_time:
            for _ in range(100):
                fn()
            calls += 100
        samples.append((time.thread_time() - start) / calls * 1e6)
    return samples
