"""Asynchronous checkpoint saves through Megatron-Core's own machinery, as Megatron-LM's training
loop drives it (`megatron/training/async_utils.py`): one `AsyncCallsQueue`; a save schedules an
`AsyncRequest` whose write runs in a forked process; every step polls without blocking (one
integer all-reduce while a save is pending, none otherwise); the finalize functions run on all
ranks once every rank's write has finished.

What runs where, for one `store.PendingSave`:
- before `schedule` returns (the training loop is blocked): `store.begin_save` (the tensors
  snapshotted to host memory, the small per-rank files written and hashed) and the fork;
- in the forked process, while training goes on: the rank's data files written, fsynced and hashed
  into its digest (`PendingSave.background`);
- at the first `poll` after every rank's process has exited, or at `wait`: the commit (manifest,
  publish, `latest`, prune). Until then `latest` names the previous checkpoint, and a crash leaves
  only the `.tmp-step_*` directory, which is never read and is removed by the next save.
"""

from __future__ import annotations

import logging

from .store import PendingSave, _crash_point

log = logging.getLogger(__name__)


class AsyncSaves:
    """The pending asynchronous saves of one run. Every method is collective: all ranks call it at
    the same point of the same step."""

    def __init__(self) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self._queue = AsyncCallsQueue(persistent=False)  # a fresh forked writer per save
        self._steps: dict[int, int] = {}  # queue call index -> checkpoint step

    def schedule(self, pending: PendingSave) -> None:
        """Hands `pending`'s heavy write to a forked process; returns at once."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        request = AsyncRequest(pending.background, (), [pending.commit])
        self._steps[self._queue.schedule_async_request(request)] = pending.step
        _crash_point("background_write")

    def poll(self) -> list[int]:
        """Commits every save whose writes have finished on all ranks; the steps committed."""
        return self._finalize(blocking=False)

    def wait(self) -> list[int]:
        """Blocks until every pending save is written and committed; the steps committed."""
        return self._finalize(blocking=True)

    def pending(self) -> int:
        return self._queue.get_num_unfinalized_calls()

    def _finalize(self, blocking: bool) -> list[int]:
        if not self.pending():
            return []
        return [self._steps.pop(i) for i in self._queue.maybe_finalize_async_calls(blocking=blocking)]
