"""A progress line with rate and ETA for long evaluations (stderr, at most one line per interval)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, unit: str = "tokens", label: str = "evaluate", interval: float = 2.0,
                 stream=None):
        self.total, self.unit, self.label, self.interval = total, unit, label, interval
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self._last = -float("inf")

    def update(self, amount: int, what: str, force: bool = False) -> None:
        self.done += amount
        now = time.perf_counter()
        if not force and now - self._last < self.interval and self.done < self.total:
            return
        self._last = now
        print(self.line(what, now - self.start), file=self.stream, flush=True)

    def line(self, what: str, elapsed: float) -> str:
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = self.total - self.done
        eta = f"{left / rate:.0f} s" if rate > 0 else "unknown"
        return (f"[{self.label}] {what} | {self.done:,}/{self.total:,} {self.unit} "
                f"({100 * self.done / max(self.total, 1):.0f}%) | {rate:,.0f} {self.unit}/s | ETA {eta}")
