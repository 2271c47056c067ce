"""A launcher for real training runs (torchrun); the tiny dataset is the root conftest's `tiny_data`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[2]

# A model small enough for 2-core CI: two layers, sequence 64, width 64.
TINY_OVERRIDES = [
    "triroute.model.n_layers=2", "triroute.model.seq_len=64", "triroute.model.d_model=64",
    "triroute.model.d_ff=128", "triroute.router.d_router=32", "train.global_batch_size=4",
    "train.micro_batch_size=2", "train.log_interval=1", "train.eval_interval=1000", "train.eval_batches=2",
    "optim.warmup_steps=2",
]


def launch(run_dir: Path, data: Path, nproc: int = 1, extra: list[str] = (), recipe: str = "tiny",
           overrides: list[str] | None = None) -> subprocess.Popen:
    """Start the trainer in its own process group: one process directly (so its exit status is the
    trainer's), several under torchrun."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [*launcher, "-m", "megatron_triroute.train", "--recipe", recipe, f"data.path={data}",
           f"output_dir={run_dir}", *(TINY_OVERRIDES if overrides is None else overrides), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    log = open(run_dir.parent / f"{run_dir.name}.log", "ab")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait(proc: subprocess.Popen, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def run_to_end(run_dir: Path, data: Path, timeout: float = 240, **kw) -> int:
    return wait(launch(run_dir, data, **kw), timeout=timeout)


def steps(run_dir: Path) -> dict[int, dict]:
    """Last record per step (a resumed run rewrites the steps after its checkpoint)."""
    out = {}
    path = run_dir / "steps.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out[rec["step"]] = rec
    return out


def wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(steps(run_dir)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early with {proc.returncode}: {log_text(run_dir)[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {timeout} s")


def moments(run_dir: Path, step: int) -> dict:
    """AdamW's whole moments in `run_dir`'s step checkpoint, by stored key ("exp_avg.model.…",
    "exp_avg_sq.model.…"): both optimizers write whole moments as global tensors, so any two
    layouts compare key by key."""
    from megatron_triroute.checkpoint.sharded import stored_tensors

    return stored_tensors(run_dir / "checkpoints" / f"step_{step:08d}" / "sharded", "optimizer.")


def assert_moments_close(have: dict, want: dict, rel: float) -> float:
    """Every moment within `rel` of the largest magnitude in its tensor (elementwise relative error
    means nothing where a moment is near zero); returns the worst such error."""
    assert want and sorted(have) == sorted(want)
    worst = 0.0
    for key, ref in want.items():
        assert have[key].shape == ref.shape, key
        off = ((have[key].double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-300)).item()
        assert off <= rel, f"{key}: off by {off:.3g} of its largest magnitude (allowed {rel:g})"
        worst = max(worst, off)
    return worst


def log_text(run_dir: Path) -> str:
    path = run_dir.parent / f"{run_dir.name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def workers(proc: subprocess.Popen) -> list[int]:
    """PIDs of the trainer processes under a torchrun launched by `launch`."""
    return [pid for pid in _descendants(proc.pid)
            if b"megatron_triroute.train" in _cmdline(pid) and b"torch.distributed.run" not in _cmdline(pid)]


def _descendants(pid: int) -> list[int]:
    out, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                out.append(int(entry))
                frontier.append(int(entry))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""
