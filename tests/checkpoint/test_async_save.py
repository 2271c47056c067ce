"""Asynchronous saves (checkpoint/async_save.py): on two gloo ranks the committed checkpoint holds
the same tensors as a blocking save of the same state, taken when the save was scheduled (training
goes on meanwhile); `latest` moves only at the commit; every file is hashed by the rank that wrote
it; a process killed while its background write is in flight leaves `latest` on the previous step."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from megatron_triroute.checkpoint import load_checkpoint, save_checkpoint
from megatron_triroute.checkpoint.store import CRASH_ENV, CRASH_EXIT_CODE
from tests.dist_utils import run_distributed
from tests.model.harness import build, tiny_triroute

REPO = Path(__file__).resolve().parents[2]


def _recording_describe(log: Path, rank: int):
    """`store.describe_file` that also appends "<rank> <path>" to `log` (from any process)."""
    from megatron_triroute.checkpoint import store

    real = store.describe_file

    def describe(path):
        with open(log, "a") as handle:
            handle.write(f"{rank} {path}\n")
        return real(path)

    store.describe_file = describe


def _async_like_blocking(rank, world_size, root):
    import torch.distributed as dist

    from megatron_triroute.checkpoint import latest_valid_checkpoint
    from megatron_triroute.checkpoint.async_save import AsyncSaves
    from megatron_triroute.checkpoint.sharded import full_model_state, load_model, plan_state_save
    from megatron_triroute.checkpoint.store import begin_save

    root = Path(root)
    _recording_describe(root / f"described.{rank}", rank)
    model, _ = build(tiny_triroute(), tp=2)  # both ranks write data files (their tensor-parallel slices)
    snapshot = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    state, meta = {"w": torch.full((3,), float(rank))}, {"step": 2}

    def args():
        return dict(rank=rank, world_size=world_size, barrier=dist.barrier,
                    write_extra=lambda directory: plan_state_save(directory, model, None))

    save_checkpoint(root / "blocking", 2, state, meta, **args())
    saves = AsyncSaves()
    saves.schedule(begin_save(root / "async", 2, state, meta, **args()))
    with torch.no_grad():  # training goes on while the background process writes
        for p in model.parameters():
            p.add_(1.0)
    tmp = root / "async" / ".tmp-step_00000002"
    deadline = time.monotonic() + 60
    while not all((tmp / f".rank_{r:05d}.digest.json").exists() for r in range(world_size)):
        assert time.monotonic() < deadline, "background writes did not finish"
        time.sleep(0.05)
    dist.barrier()
    # Every rank's write is done, but nothing is committed before the queue finalizes.
    assert not (root / "async" / "latest").exists()
    assert not (root / "async" / "step_00000002").exists()
    assert saves.wait() == [2] and saves.pending() == 0
    assert (root / "async" / "latest").read_text() == "step_00000002\n"
    dist.barrier()

    # The existing loader verifies and reads it: the tensors as they were when the save was scheduled.
    assert latest_valid_checkpoint(root / "async").step == 2
    step, tree, loaded_meta = load_checkpoint(root / "async", rank, world_size=world_size)
    assert (step, loaded_meta) == (2, meta) and tree["w"].equal(state["w"])
    load_model(root / "async" / "step_00000002" / "sharded", model)
    for key, value in model.state_dict().items():
        if torch.is_tensor(value):
            assert value.equal(snapshot[key]), key
    if rank == 0:
        blocking = full_model_state(root / "blocking" / "step_00000002" / "sharded")
        background = full_model_state(root / "async" / "step_00000002" / "sharded")
        assert sorted(blocking) == sorted(background)
        for key in blocking:
            assert blocking[key].equal(background[key]), key
        for other in range(world_size):
            assert load_checkpoint(root / "blocking", other)[1]["w"].equal(load_checkpoint(root / "async", other)[1]["w"])
    dist.barrier()


def test_async_save_commits_the_state_it_was_scheduled_with(tmp_path):
    import json

    run_distributed(_async_like_blocking, 2, str(tmp_path))
    for mode in ("blocking", "async"):
        final = tmp_path / mode / "step_00000002"
        manifest = json.loads((final / "manifest.json").read_text())["files"]
        data = sorted(n for n in manifest if n.endswith(".distcp"))
        assert data == ["sharded/__0_0.distcp", "sharded/__0_1.distcp", "sharded/__1_0.distcp",
                        "sharded/__1_1.distcp"], data
        # Each file of this save was hashed once, by the rank whose name it carries (rank 0: the rest).
        by_rank = {}
        for r in (0, 1):
            for line in (tmp_path / f"described.{r}").read_text().splitlines():
                who, path = line.split(" ", 1)
                prefix = str(tmp_path / mode / ".tmp-step_00000002") + "/"
                if path.startswith(prefix):
                    name = path[len(prefix):]
                    assert name not in by_rank, f"{name} hashed twice"
                    by_rank[name] = int(who)
        assert sorted(by_rank) == sorted(manifest)
        for name, who in by_rank.items():
            writer = int(name.split("/")[-1].split("_")[2]) if name.endswith(".distcp") else \
                int(name[len("rank_"):len("rank_00000")]) if name.startswith("rank_") else 0
            assert who == writer, (mode, name, who)


CRASHING_ASYNC_SAVE = textwrap.dedent(
    """
    import sys, time, torch
    import torch.distributed as dist
    from megatron_triroute.checkpoint.store import ExtraWrite, begin_save, save_checkpoint
    from megatron_triroute.parallel import cpu_shim

    def slow(directory):
        def run():
            time.sleep(float(sys.argv[2]))
            directory.mkdir()
            (directory / "part.bin").write_bytes(b"x" * 1000)
            return [directory / "part.bin"]
        return ExtraWrite(run)

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=0, world_size=1)
    with cpu_shim():
        from megatron_triroute.checkpoint.async_save import AsyncSaves

        save_checkpoint(sys.argv[1], 1, {"n": 1}, {"step": 1}, barrier=dist.barrier, write_extra=slow)
        saves = AsyncSaves()
        saves.schedule(begin_save(sys.argv[1], 2, {"n": 2}, {"step": 2}, barrier=dist.barrier, write_extra=slow))
        print("scheduled", flush=True)
        saves.wait()
        print("committed", flush=True)
    """
)


def test_killed_during_async_save_keeps_previous_latest(tmp_path):
    # The commit's own crash points ("before_rename", "before_latest") are the blocking save's, in
    # store._commit: test_checkpoint_store.py kills a save at each.
    from tests.dist_utils import free_port

    root = tmp_path / "ckpt"
    environ = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **{CRASH_ENV: "background_write"})
    with open(tmp_path / "out.log", "w") as log:  # a file, not a pipe the writer would hold open
        proc = subprocess.Popen([sys.executable, "-c", CRASHING_ASYNC_SAVE, str(root), "1.0", str(free_port())],
                                env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc.wait(timeout=120)
    out = (tmp_path / "out.log").read_text()
    try:  # the node goes down: the background writer (sleeping before it writes) dies with the trainer
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    assert proc.returncode == CRASH_EXIT_CODE, out
    assert "committed" not in out
    assert (root / "latest").read_text() == "step_00000001\n"
    time.sleep(1.2)  # past the writer's sleep: it never wrote, so no digest either
    assert sorted(p.name for p in (root / ".tmp-step_00000002").iterdir()) == ["meta.json", "rank_00000.json",
                                                                            "rank_00000.safetensors"]
    assert load_checkpoint(root)[1:] == ({"n": 1}, {"step": 1})
    # The next save cleans up and commits.
    save_checkpoint(root, 2, {"n": 3}, {"step": 2})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    assert load_checkpoint(root)[:2] == (2, {"n": 3})
