"""The multi-process harness itself: a passing group ends with status 0 after its exit handlers ran
(a manager a rank started is shut down, not orphaned) and without the interpreter's finalisation
(where a gloo worker thread can abort the process); a rank's failed check reaches the parent; a rank
forked from the preloaded server sees the environment of the call and nothing it did not import
itself, and its output reaches the test that started it."""

import os
import sys
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


def _report_environment_and_modules(rank: int, world_size: int, root: str) -> None:
    Path(root, f"env_{rank}").write_text(f"{os.environ.get('TRIROUTE_HARNESS_PROBE')}|{os.environ.get('OMP_NUM_THREADS')}|"
                                         f"{'TRIROUTE_HARNESS_GONE' in os.environ}")
    # the server preloads third-party libraries only: the project modules here are the rank's own imports
    Path(root, f"modules_{rank}").write_text(" ".join(sorted(m for m in sys.modules if m.startswith("megatron_triroute"))))
    print(f"rank {rank} says hello on stdout")
    print(f"rank {rank} says hello on stderr", file=sys.stderr)


def _rank_one_dies_silently(rank: int, world_size: int) -> None:
    if rank == 1:
        print("rank 1's last words", file=sys.stderr, flush=True)
        os._exit(7)


def _rank_one_dies_then_rank_zero_reports(rank: int, world_size: int, flag: str) -> None:
    """Rank 1 dies without a report; rank 0 (deaf to the SIGTERM that ends a failed group's other
    ranks) reports only after it, as a peer whose connection was reset does. Rank 1 waits until rank
    0 is deaf (else the SIGTERM can end rank 0 before it reports)."""
    import signal

    ready = flag + ".deaf"
    if rank == 1:
        while not os.path.exists(ready):
            time.sleep(0.01)
        print("rank 1's last words", file=sys.stderr, flush=True)
        Path(flag).touch()
        os._exit(7)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(ready).touch()
    while not os.path.exists(flag):
        time.sleep(0.01)
    time.sleep(0.2)
    raise RuntimeError("Connection reset by peer")


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


def test_a_rank_sees_the_environment_of_the_call_and_its_output_reaches_the_test(tmp_path, monkeypatch, capfd):
    first = tmp_path / "first"
    first.mkdir()
    monkeypatch.setenv("TRIROUTE_HARNESS_GONE", "1")
    run_distributed(_report_environment_and_modules, 1, str(first))  # the fork server runs from here on
    assert (first / "env_0").read_text() == "None|1|True"
    monkeypatch.setenv("TRIROUTE_HARNESS_PROBE", "set after the server started")
    monkeypatch.delenv("TRIROUTE_HARNESS_GONE")
    run_distributed(_report_environment_and_modules, 2, str(tmp_path))
    for rank in range(2):
        assert (tmp_path / f"env_{rank}").read_text() == "set after the server started|1|False"
        modules = (tmp_path / f"modules_{rank}").read_text().split()
        assert "megatron_triroute.parallel.cpu_compat" in modules  # the shim, imported by the rank
        assert not any(m.startswith(("megatron_triroute.inference", "megatron_triroute.training")) for m in modules)
    _, err = capfd.readouterr()
    for rank in range(2):
        assert f"rank {rank} says hello on stdout" in err and f"rank {rank} says hello on stderr" in err


def test_a_rank_that_dies_without_reporting_fails_the_group_with_its_last_output():
    with pytest.raises(AssertionError, match=r"(?s)exited with codes \[.*7.*\].*rank 1: .*rank 1's last words"):
        run_distributed(_rank_one_dies_silently, 2, timeout=60)


def test_a_silent_death_leads_the_message_ahead_of_the_report_a_peer_makes_after_it(tmp_path):
    """The order a flaky group showed: rank 1 exits 7 without a report, then rank 0 reports the reset
    connection. The message names the death first, with its last output, and keeps the report."""
    with pytest.raises(AssertionError) as failure:
        run_distributed(_rank_one_dies_then_rank_zero_reports, 2, str(tmp_path / "dead"), timeout=60)
    text = str(failure.value)
    assert text.startswith("_rank_one_dies_then_rank_zero_reports on 2 processes exited with codes [1, 7]"), text
    assert "rank(s) [1] died without reporting" in text and "rank 1's last words" in text
    assert text.index("rank 1's last words") < text.index("rank 0 reported after it") < text.index("reset by peer")


def test_ranks_are_forked_from_the_preloaded_server_only_for_gloo_without_cuda(monkeypatch):
    import torch

    from tests.dist_utils import _start_method

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _start_method("gloo") == "forkserver" and _start_method("nccl") == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the server would initialise the driver
    assert _start_method("gloo") == "spawn"
