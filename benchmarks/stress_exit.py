"""Launch the same short multi-rank training run many times and count how each launch ended.

    python benchmarks/stress_exit.py --data data/tiny --launches 20 [--nproc 2] [--json]

A run that finishes must exit 0 on every launch: an abort in a process's teardown (torch's C++
destructors, "terminate called without an active exception") turns a finished run into exit 134,
which a Slurm script reads as a failure and does not requeue. Each launch is torchrun with
`--nproc` ranks (one process each, as srun starts them: each rank's own status is counted) of the `tiny` recipe at a two-layer width-64 shape for `--steps` steps (a fresh
output directory each time); `--signal-at` sends SIGUSR1 once that many steps are logged, and the
launch's every rank must then exit 75 (checkpointed, wants a requeue). Prints the launches' statuses (a
launch's status is its first rank's unexpected one, else the expected one), their counts,
the launches per second, and a failing launch's log tail; exits 1 unless every launch ended as
expected.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = [
    "triroute.model.n_layers=2", "triroute.model.seq_len=64", "triroute.model.d_model=64", "triroute.model.d_ff=128",
    "triroute.router.d_router=32", "train.global_batch_size=4", "train.micro_batch_size=2", "train.log_interval=1",
    "train.eval_interval=1000", "train.eval_batches=2", "optim.warmup_steps=2",
]


def launch(data: Path, out: Path, nproc: int, steps: int) -> list[subprocess.Popen]:
    """`nproc` trainer processes, one per rank (RANK/WORLD_SIZE/MASTER_* as torchrun or srun would
    set them), so each rank's exit status is the trainer's own."""
    cmd = [sys.executable, "-m", "megatron_triroute.train", "--recipe", "tiny", f"data.path={data}",
           f"output_dir={out}", f"train.steps={steps}", *SHAPE]
    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        log = open(out.parent / f"{out.name}.rank{rank}.log", "wb")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def logged_steps(out: Path) -> int:
    path = out / "steps.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def one(data: Path, work: Path, index: int, nproc: int, steps: int, signal_at: int, timeout: float) -> list[int]:
    """Every rank's exit status (-9: killed at the timeout)."""
    out = work / f"launch_{index:03d}"
    procs = launch(data, out, nproc, steps)
    deadline = time.monotonic() + timeout
    sent = False
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            break
        if signal_at and not sent and logged_steps(out) >= signal_at:
            for p in procs:  # the job's signal reaches every task, as Slurm delivers it
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGUSR1)
            sent = True
        time.sleep(0.1)
    return [p.returncode for p in procs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, type=Path, help="a `python -m data_prep build` output directory")
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--signal-at", type=int, default=0, help="SIGUSR1 after this many steps (0: never)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    expected = 75 if args.signal_at else 0
    statuses = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stress_exit_") as tmp:
        work = Path(tmp)
        for i in range(args.launches):
            ranks = one(args.data.resolve(), work, i, args.nproc, args.steps, args.signal_at, args.timeout)
            status = next((s for s in ranks if s != expected), expected)
            statuses.append(status)
            elapsed = time.monotonic() - start
            eta = elapsed / (i + 1) * (args.launches - i - 1)
            print(f"[stress_exit] launch {i + 1}/{args.launches}: exit {status} "
                  f"({(i + 1) / elapsed:.3f} launches/s, ETA {eta:.0f} s)", file=sys.stderr, flush=True)
            if status != expected:
                for rank in range(args.nproc):
                    tail = (work / f"launch_{i:03d}.rank{rank}.log").read_text(errors="replace")[-2000:]
                    print(f"[stress_exit] launch {i + 1} rank {rank} (exit {ranks[rank]}) log tail:\n{tail}",
                          file=sys.stderr)
    counts = dict(collections.Counter(statuses))
    report = {"launches": args.launches, "nproc": args.nproc, "expected_status": expected,
              "statuses": statuses, "counts": {str(k): v for k, v in sorted(counts.items())},
              "unexpected": sum(s != expected for s in statuses), "seconds": round(time.monotonic() - start, 1)}
    print(json.dumps(report) if args.json else
          f"{args.launches} launches of {args.nproc} ranks: exit statuses {report['counts']}, "
          f"{report['unexpected']} unexpected (expected {expected}), {report['seconds']} s")
    return 0 if report["unexpected"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
