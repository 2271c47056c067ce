"""Graceful stop on SIGTERM / SIGUSR1: the handler only sets a flag; the training loop checks it at a
step boundary, checkpoints, and exits with EXIT_REQUEUE.

Import and call `install_stop_handlers()` first thing in an entry point, before `import torch`:
importing torch takes seconds, and a Slurm pre-emption signal arriving meanwhile would otherwise
kill the process with the default action. This module therefore imports only the standard library.

Across ranks, signals arrive at different times (or at one rank only). `stop_agreed(all_reduce_max)`
makes every rank stop at the same step: any rank's flag stops all.
"""

from __future__ import annotations

import signal
from typing import Callable, Iterable

EXIT_FINISHED = 0
"""Training reached its last step."""
EXIT_REQUEUE = 75
"""Checkpointed because a stop signal arrived: resume me (75 is sysexits' EX_TEMPFAIL)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received: list[int] = []


def install_stop_handlers(signals: Iterable[int] = STOP_SIGNALS) -> None:
    """Replaces the handlers of `signals` with one that records the signal. Main thread only
    (a Python rule for signal handlers)."""
    for signum in signals:
        signal.signal(signum, _record)


def _record(signum: int, frame: object) -> None:
    _received.append(signum)  # list.append is atomic; no allocation-heavy work in a handler


def stop_requested() -> bool:
    """True once any stop signal arrived (or `request_stop` was called) in this process."""
    return bool(_received)


def stop_signal() -> int | None:
    """The first stop signal received, e.g. `signal.SIGUSR1`, or None."""
    return _received[0] if _received else None


def request_stop(signum: int = signal.SIGTERM) -> None:
    """Marks a stop as if `signum` had arrived (for a programmatic stop and for tests)."""
    _received.append(signum)


def clear_stop_request() -> None:
    _received.clear()


def stop_agreed(all_reduce_max: Callable[[int], int]) -> bool:
    """Collective: True on every rank if any rank's flag is set. `all_reduce_max(x)` must return the
    maximum of `x` over all ranks (see `torch_all_reduce_max`). Call it at the same point of every
    step on every rank; a rank that learns of the stop this way also marks its own flag."""
    stop = all_reduce_max(1 if stop_requested() else 0) > 0
    if stop and not stop_requested():
        request_stop()
    return stop


def torch_all_reduce_max(group: object = None) -> Callable[[int], int]:
    """An `all_reduce_max` over a torch.distributed group (imports torch only when called)."""
    import torch
    import torch.distributed as dist

    from ..parallel.devices import collective_device

    device = collective_device(group)

    def reduce(value: int) -> int:
        flag = torch.tensor([value], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())

    return reduce
