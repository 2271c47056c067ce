"""Progress lines for long work: the rate and the time left, one format everywhere.

`clock` writes a duration as h:mm:ss (the ETA of every progress line: training's step line,
data_prep's shard line, evaluation, calibration, the sweep, the export); `Progress` is the line of
work measured in units of a known total (tokens, price points, runs, megabytes), printed to stderr at
most once per interval.
"""

from __future__ import annotations

import math
import sys
import time


def clock(seconds: float) -> str:
    """seconds as h:mm:ss (hours unbounded); "?" when not finite (no rate yet)."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(max(0.0, seconds))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def eta(done: float, total: float, elapsed: float) -> float:
    """Seconds left for `total` units at the rate of `done` in `elapsed` seconds (inf: no rate yet)."""
    if done <= 0 or elapsed <= 0:
        return math.inf
    return max(0.0, total - done) * elapsed / done


def rate_text(per_second: float) -> str:
    """A rate with the digits it needs: 12,345 / 12.3 / 0.123."""
    if per_second >= 100:
        return f"{per_second:,.0f}"
    return f"{per_second:.1f}" if per_second >= 1 else f"{per_second:.3f}"


def amount_text(amount: float) -> str:
    """A count as a whole number (12,345), a measure (a float: megabytes) to one decimal (12.3)."""
    return f"{amount:,.1f}" if isinstance(amount, float) else f"{amount:,}"


class Progress:
    """`[label] what | done/total unit (percent) | rate unit/s | ETA h:mm:ss` on `stream` (stderr),
    printed by `update` at most once per `interval` seconds, and always at the last unit or when forced.
    `total` and the amounts: counts (int), or a measure such as megabytes (float)."""

    def __init__(self, total: float, unit: str = "tokens", label: str = "evaluate", interval: float = 2.0,
                 stream=None):
        self.total, self.unit, self.label, self.interval = total, unit, label, interval
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self._last = -float("inf")

    def update(self, amount: float, what: str, force: bool = False) -> None:
        self.done += amount
        now = time.perf_counter()
        if not force and now - self._last < self.interval and self.done < self.total:
            return
        self._last = now
        print(self.line(what, now - self.start), file=self.stream, flush=True)

    def line(self, what: str, elapsed: float) -> str:
        rate = self.done / elapsed if elapsed > 0 else 0.0
        percent = 100 * self.done / self.total if self.total else 100.0
        return (f"[{self.label}] {what} | {amount_text(self.done)}/{amount_text(self.total)} {self.unit} "
                f"({percent:.0f}%) | {rate_text(rate)} {self.unit}/s | ETA {clock(eta(self.done, self.total, elapsed))}")
