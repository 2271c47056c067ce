"""Run a test function on N gloo processes on one CPU machine.

On a machine without CUDA the ranks are forked from a fork server that has imported torch,
Megatron-Core and DeepSpeed once (`PRELOAD`), so a group starts without the 3-6 s of imports each
freshly spawned rank pays on a 2-core machine (with CUDA they are spawned: `_start_method`). Each
rank is still a fresh process for what a test touches: the server only imports third-party
libraries (no process group, no device, no test or project code), a rank takes the parent's
environment as it is at the call (not as it was when the server started), and its output (stdout,
stderr, a fatal signal's stack) is handed to the test that started it. A test should still batch
several checks into one call rather than start a group per check.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "megatron.core", "megatron.core.parallel_state", "deepspeed")
"""What the fork server imports once for every rank: third-party libraries only (their import does not
depend on this project's environment switches), never this project's modules, which each rank imports
itself after taking the parent's environment."""


def _start_method(backend: str) -> str:
    """The fork server (its preload set applies when it starts: the first call) for gloo on a machine
    without CUDA. With CUDA, fresh spawned processes: importing DeepSpeed asks torch whether CUDA is
    available, which initialises the CUDA driver in the server, and a process forked after that
    cannot use the GPU."""
    import torch

    if backend != "gloo" or torch.cuda.is_available():
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors, shim: bool, backend: str,
            environ: dict, output: str) -> None:
    # The fork server's stdout and stderr are those of the test that started it: this rank writes
    # to its own file instead, which the parent hands to the test now running (`_hand_over_output`).
    log = os.open(os.path.join(output, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()  # the parent's environment at the call, not the fork server's
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 4 ranks x default threads would oversubscribe a 2-core machine
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    faulthandler.enable()  # a fatal signal (SIGABRT, SIGSEGV) prints this rank's Python stack to stderr
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        from megatron_triroute.parallel.cpu_compat import cpu_shim

        with cpu_shim() if shim else contextlib.nullcontext():  # each rank's entry point (no-op with CUDA)
            fn(rank, world_size, *args)
        # Leave together: after this barrier no collective of this group is in flight.
        dist.barrier()
        dist.destroy_process_group()
        status = 0
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, including asserts
        errors.put((rank, traceback.format_exc()))
        if dist.is_initialized():
            dist.destroy_process_group()
        status = 1
    _exit_now(status)


def _exit_now(status: int) -> None:
    """End a rank once its work is done and reported: its exit handlers run (`atexit`: a manager it
    started is shut down), its output is flushed, and then the process ends without the
    interpreter's finalisation.

    A gloo process group outlives `destroy_process_group` while anything still references it
    (importing `torch._dynamo` after `init_process_group` takes ten references). Its worker thread
    drops the last reference to a finished collective, and to the tensors it holds, a moment after
    the caller's `wait()` returned. When that moment falls inside the interpreter's finalisation,
    the thread needs the GIL to free the tensors, is made to exit, and the process aborts
    ("terminate called without an active exception", SIGABRT; measured: 1 rank exit in about 40
    of tests/routing/test_running_stats_distributed.py). Nothing a rank leaves needs finalising:
    its report went through the queue's pipe."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120,
                    cpu_shim: bool = True, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes (module docstring).

    ``torch.distributed`` is initialised (gloo, localhost, a free port) before ``fn`` runs; the ranks
    then meet at a barrier and destroy their process groups before they exit, or a failing rank
    destroys its process groups and exits 1; ``fn`` runs inside the CPU shim (``cpu_shim=False``: without it).
    ``backend="nccl"`` (GPU machines) gives rank r the CUDA device r. ``fn`` must be a module-level function (it is pickled by name). The first
    rank to report a failure has its traceback is re-raised in the parent as an ``AssertionError``; a rank that dies
    without reporting (segfault, kill, an exit of its own) fails the group with its exit code and last output, ahead
    of the reports its peers make after it (a reset connection); a group that outlives ``timeout`` seconds also fails.
    """
    start_method = _start_method(backend)
    errors = mp.get_context(start_method).SimpleQueue()
    port = free_port()
    environ = dict(os.environ, OMP_NUM_THREADS="1")  # 4 ranks x default threads would oversubscribe 2 cores
    with tempfile.TemporaryDirectory(prefix="ranks-") as output:
        context = mp.start_processes(
            _worker,
            args=(world_size, port, fn, args, errors, cpu_shim, backend, environ, output),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        reports: list[tuple[int, str]] = []
        try:
            finished = _join_all(context, timeout, errors, reports)
            if not finished:
                _terminate(context)
        finally:
            silent = _hand_over_output(output, world_size)
    while not errors.empty():
        reports.append(errors.get())
    codes = [p.exitcode for p in context.processes]
    # A rank that died without reporting (an exit code of its own or a signal, not the SIGTERM that
    # ends the rest of a failed group) is the cause: its peers' reports (a reset connection) come after.
    reported = {rank for rank, _ in reports}
    died = [r for r, code in enumerate(codes) if code not in (0, None, -signal.SIGTERM) and r not in reported]
    if died and finished:
        after = f"\n\nrank {reports[0][0]} reported after it:\n{reports[0][1]}" if reports else ""
        raise AssertionError(f"{fn.__name__} on {world_size} processes exited with codes {codes}: rank(s) {died} "
                             f"died without reporting; the last of their output:\n{silent}{after}")
    if reports:
        rank, tb = reports[0]  # the first report is usually the cause; later ones see a dead peer
        raise AssertionError(f"rank {rank} of {world_size} failed ({len(reports)} rank(s) reported):\n{tb}")
    if not finished:
        raise AssertionError(f"{world_size} processes running {fn.__name__} did not finish in {timeout} s")
    if any(code != 0 for code in codes):
        raise AssertionError(f"{fn.__name__} on {world_size} processes exited with codes {codes}; the last of "
                             f"their output:\n{silent}")


def _hand_over_output(output: str, world_size: int) -> str:
    """Write each rank's output to this process's stderr (where the running test's capture takes
    it); return its last lines, for the report of a rank that died without reporting."""
    tails = []
    for rank in range(world_size):
        path = os.path.join(output, f"rank{rank}.log")
        if not os.path.exists(path):  # the rank never started
            continue
        with open(path, errors="replace") as log:
            text = log.read()
        if text:
            sys.stderr.write(f"----- rank {rank} of {world_size} -----\n{text}")
            tails.append(f"rank {rank}: " + "\n".join(text.splitlines()[-20:]))
    return "\n".join(tails)


def _join_all(context, timeout: float, errors, reports: list) -> bool:
    """Wait for every process, draining reported errors meanwhile (a full pipe would block a child).

    True when all processes ended (or one failed, after which torch terminates the rest) before
    ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        while not errors.empty():
            reports.append(errors.get())
        try:
            if context.join(timeout=1.0):
                return True
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            return True
    return False


def _terminate(context) -> None:
    for process in context.processes:
        if process.is_alive():
            process.terminate()
    for process in context.processes:
        process.join(5)
        if process.is_alive():
            process.kill()
