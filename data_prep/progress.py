"""A progress line on stderr: documents/s, tokens/s and ETA, fed by all worker processes.

Workers add to shared counters (`multiprocessing.Value`) in batches, so the lock is taken a few
times a second rather than once per document; the main process prints from a ticker thread.
On a terminal the line rewrites itself; in a log file (Slurm) a line is appended every
`log_interval` seconds.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from typing import Optional

from megatron_triroute.progress import clock, eta


def _human(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


class Counters:
    """Totals shared between processes: documents, tokens, work units (bytes or docs), shards."""

    FIELDS = ("docs", "tokens", "units", "shards")

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self._values = {name: ctx.Value("q", 0) for name in self.FIELDS}

    def add(self, **amounts: int) -> None:
        for name, amount in amounts.items():
            if amount:
                value = self._values[name]
                with value.get_lock():
                    value.value += amount

    def read(self) -> dict[str, int]:
        return {name: value.value for name, value in self._values.items()}


class Tally:
    """A worker-local buffer in front of `Counters`, flushed every `flush_every` seconds."""

    def __init__(self, counters: Optional[Counters], flush_every: float = 0.5):
        self.counters = counters
        self.flush_every = flush_every
        self.pending = dict.fromkeys(Counters.FIELDS, 0)
        self.last = time.monotonic()

    def add(self, **amounts: int) -> None:
        for name, amount in amounts.items():
            self.pending[name] += amount
        if time.monotonic() - self.last >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self.counters is not None:
            self.counters.add(**self.pending)
        self.pending = dict.fromkeys(Counters.FIELDS, 0)
        self.last = time.monotonic()


class ProgressLine:
    """Prints `stage: shards | docs, docs/s | tokens, tokens/s | ETA` from `start()` to `close()`."""

    def __init__(self, stage: str, counters: Counters, total_units: int, total_shards: int,
                 tick: float = 1.0, log_interval: float = 10.0, stream=None):
        self.stage = stage
        self.counters = counters
        self.total_units = max(1, total_units)
        self.total_shards = total_shards
        self.stream = stream or sys.stderr
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.tick = tick
        self.log_interval = log_interval
        self.started_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._thread.start()

    def line(self) -> str:
        now = self.counters.read()
        elapsed = max(1e-6, time.monotonic() - self.started_at)
        fraction = min(1.0, now["units"] / self.total_units)
        eta_text = clock(eta(fraction, 1.0, elapsed))
        return (f"[data_prep] {self.stage}: {now['shards']}/{self.total_shards} shards | "
                f"{_human(now['docs'])} docs ({_human(now['docs'] / elapsed)}/s) | "
                f"{_human(now['tokens'])} tokens ({_human(now['tokens'] / elapsed)}/s) | "
                f"{fraction:5.1%} | ETA {eta_text}")

    def _run(self) -> None:
        last_logged = 0.0
        while not self._stop.wait(self.tick):
            if self.interactive:
                self.stream.write("\r" + self.line())
                self.stream.flush()
            elif time.monotonic() - last_logged >= self.log_interval:
                last_logged = time.monotonic()
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def close(self) -> float:
        """Stop ticking, print the final line; returns the elapsed seconds."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        elapsed = time.monotonic() - self.started_at
        self.stream.write(("\r" if self.interactive else "") + self.line() + f" | done in {elapsed:.1f}s\n")
        self.stream.flush()
        return elapsed
