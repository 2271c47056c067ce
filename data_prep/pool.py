"""Run one function per shard on N worker processes (or inline for N = 1).

Results come back in submission (canonical shard) order whatever order workers finish in, so
nothing downstream can depend on scheduling. `fork` is used because the parent has already
imported the heavy libraries; workers only use numpy and sentencepiece, never torch kernels.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from typing import Callable, Optional, Sequence, TypeVar

from data_prep.config import PrepError
from data_prep.progress import Counters

T = TypeVar("T")
R = TypeVar("R")

_worker_counters: Optional[Counters] = None


def worker_counters() -> Optional[Counters]:
    """The progress counters of the current process (set in workers and in inline runs)."""
    return _worker_counters


def _init_worker(counters: Optional[Counters]) -> None:
    global _worker_counters
    _worker_counters = counters


def map_shards(fn: Callable[[T], R], items: Sequence[T], workers: int,
               counters: Optional[Counters] = None, describe: Callable[[T], str] = str,
               on_started: Callable[[], None] = lambda: None) -> list[R]:
    """`[fn(item) for item in items]`, in parallel. A failure names the item it happened on.

    `on_started` runs once the worker processes exist. Threads (like the progress ticker) must
    start there, not before: a thread holding a lock at fork time would leave that lock held
    forever in the child.
    """
    _init_worker(counters)
    if workers <= 1 or len(items) <= 1:
        on_started()
        results = []
        for item in items:
            try:
                results.append(fn(item))
            except PrepError:
                raise
            except Exception as err:
                raise RuntimeError(f"while processing {describe(item)}: {err}") from err
        return results
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(items)), mp_context=ctx,
                                                initializer=_init_worker, initargs=(counters,)) as pool:
        futures = [pool.submit(fn, item) for item in items]  # the fork context starts every worker here
        on_started()
        results = []
        for item, future in zip(items, futures):
            try:
                results.append(future.result())
            except Exception as err:
                for pending in futures:
                    pending.cancel()
                if isinstance(err, PrepError):
                    raise
                raise RuntimeError(f"while processing {describe(item)}: {err}") from err
        return results
