"""Progress of long jobs (builds, imports, push, pull, bench), on a terminal and in a log.

On a terminal, a tqdm bar. Anywhere else -- nohup, torchrun, SLURM, a pipe -- tqdm's ``disable=None``
prints nothing until the job ends, so :func:`progress_bar` writes one line to stderr every
``LATENTFAST_PROGRESS_INTERVAL`` seconds instead (default 10; ``0``: a line at every update), and
:func:`heartbeat` says a job without counted steps (a benchmark suite) is still running.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from .errors import InvalidArgumentError

INTERVAL_ENV = "LATENTFAST_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0
MIN_HEARTBEAT_S = 0.05  # a heartbeat waits between its lines: interval 0 must not spin


def interval_s() -> float:
    """Seconds between two progress lines in a log (``LATENTFAST_PROGRESS_INTERVAL``, default 10)."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # (also refuses nan)
        raise InvalidArgumentError(f"{INTERVAL_ENV} must be a number of seconds >= 0, got {text!r}")
    return value


def _on_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def progress_bar(iterable=None, *, total=None, initial=0, desc="", unit="it", disable=None, file=None):
    """tqdm's ``tqdm(iterable, total=, initial=, desc=, unit=, disable=)``, where ``disable=None`` (the
    default) means a bar on a terminal and a :class:`LogProgress` elsewhere; ``disable=True``: nothing
    (a bar that prints nothing, so call sites keep ``update``/``close``). ``file``: default stderr."""
    from tqdm import tqdm

    stream = sys.stderr if file is None else file
    if disable or _on_terminal(stream):
        return tqdm(iterable, total=total, initial=initial, desc=desc, unit=unit, disable=bool(disable), file=stream)
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    return LogProgress(iterable, total=total, initial=initial, desc=desc, unit=unit, file=file)


class LogProgress:
    """A progress bar for a log: ``desc: n/total unit (pct%), rate, elapsed, time left`` on stderr at
    most every :func:`interval_s` seconds, and a last line at close if it printed any before."""

    def __init__(self, iterable=None, *, total=None, initial=0, desc="", unit="it", file=None):
        self.iterable, self.total, self.desc, self.unit, self.file = iterable, total, desc, unit, file
        self.n = self.initial = int(initial)
        self.interval = interval_s()
        self.start = self.last = time.monotonic()
        self.printed = self.closed = False

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._print(now)

    def close(self) -> None:
        if self.printed and not self.closed:  # the log ends with the final count
            self._print(time.monotonic())
        self.closed = True

    def line(self, now: float) -> str:
        elapsed = now - self.start
        done = f"{self.n:,}/{self.total:,}" if self.total else f"{self.n:,}"
        text = f"{self.desc}: {done} {self.unit}"
        if self.total:
            text += f" ({100 * self.n / self.total:.0f}%)"
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        text += f", {rate:.3g} {self.unit}/s, {elapsed:.0f} s elapsed"
        if self.total and rate > 0 and self.n < self.total:
            text += f", about {(self.total - self.n) / rate:.0f} s left"
        return text

    def _print(self, now: float) -> None:
        print(self.line(now), file=sys.stderr if self.file is None else self.file, flush=True)
        self.printed = True


@contextlib.contextmanager
def heartbeat(desc: str, file=None):
    """While the block runs, a line ``desc: still running (N s)`` every :func:`interval_s` seconds
    (at least :data:`MIN_HEARTBEAT_S`) when ``file`` (default stderr) is not a terminal."""
    stream = sys.stderr if file is None else file
    if _on_terminal(stream):
        yield
        return
    wait, start, done = max(interval_s(), MIN_HEARTBEAT_S), time.monotonic(), threading.Event()

    def beat():
        while not done.wait(wait):
            print(f"{desc}: still running ({time.monotonic() - start:.0f} s)", file=sys.stderr if file is None else file,
                  flush=True)

    thread = threading.Thread(target=beat, name="latentfast-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
