"""The multi-process harness itself: a passing group ends with status 0 after its exit handlers ran
(a manager a rank started is shut down, not orphaned) and without the interpreter's finalisation
(where a gloo worker thread can abort the process); a rank's failed check reaches the parent."""

import os
import time
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

_ALIVE_UNTIL_EXIT = []  # a manager dropped earlier is shut down by its finalizer, not the exit handlers


def _start_a_manager(rank: int, world_size: int, root: str) -> None:
    import multiprocessing

    import torch
    import torch.distributed as dist

    manager = multiprocessing.get_context("fork").Manager()  # shut down by multiprocessing's exit handler
    _ALIVE_UNTIL_EXIT.append(manager)
    Path(root, f"manager_{rank}.pid").write_text(str(manager._process.pid))
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert total.item() == world_size * (world_size + 1) / 2


def _mark_exit_handlers_and_finalisation(rank: int, world_size: int, root: str) -> None:
    import atexit
    import threading

    atexit.register(Path(root, f"atexit_{rank}").write_text, "ran")
    # The interpreter's finalisation starts by joining every non-daemon thread: this one would write
    # its file 10 s later, long after the rank has otherwise ended.
    threading.Thread(target=lambda: (time.sleep(10), Path(root, f"finalised_{rank}").write_text("joined"))).start()


def _rank_one_fails(rank: int, world_size: int) -> None:
    assert rank != 1, "rank 1's own check failed"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_passing_group_runs_its_exit_handlers(tmp_path):
    run_distributed(_start_a_manager, 2, str(tmp_path))
    pids = [int((tmp_path / f"manager_{rank}.pid").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), pids


def test_a_failed_check_on_one_rank_fails_the_group_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed.*rank 1's own check failed"):
        run_distributed(_rank_one_fails, 2)


def test_a_rank_ends_after_its_exit_handlers_without_finalisation(tmp_path):
    run_distributed(_mark_exit_handlers_and_finalisation, 2, str(tmp_path))
    for rank in range(2):
        assert (tmp_path / f"atexit_{rank}").read_text() == "ran"
        assert not (tmp_path / f"finalised_{rank}").exists()
