"""Two gloo processes save and load their own shards, and one rank reads the other's (re-sharding)."""

import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_state(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return {
        "model": {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen).to(torch.bfloat16)},
        "data": {"rank": rank, "consumed": step * 8},
    }


def _save_and_load(rank: int, root: str, port: int, errors) -> None:
    import torch.distributed as dist

    from megatron_triroute.checkpoint import list_checkpoints, load_checkpoint, load_shards, save_checkpoint
    from megatron_triroute.training.signals import request_stop, stop_agreed, torch_all_reduce_max

    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
        )
        for step in (1, 2, 3):
            save_checkpoint(
                root, step, _rank_state(rank, step), {"step": step, "world": WORLD_SIZE},
                rank=rank, world_size=WORLD_SIZE, barrier=dist.barrier, keep_last=2,
            )
        assert [c.step for c in list_checkpoints(root)] == [2, 3]
        step, state, meta = load_checkpoint(root, rank, world_size=WORLD_SIZE)
        assert (step, meta) == (3, {"step": 3, "world": WORLD_SIZE})
        expected = _rank_state(rank, 3)
        assert state["data"] == expected["data"]
        for key in ("w", "b"):
            assert state["model"][key].equal(expected["model"][key])
        # Re-sharding: any rank can read every shard and merge.
        _, shards, _ = load_shards(root, step=2)
        for other in range(WORLD_SIZE):
            assert shards[other]["model"]["w"].equal(_rank_state(other, 2)["model"]["w"])

        # Stop agreement: a signal seen by rank 1 only stops both ranks at the same step.
        reduce_max = torch_all_reduce_max()
        assert stop_agreed(reduce_max) is False
        if rank == 1:
            request_stop()
        assert stop_agreed(reduce_max) is True
        dist.barrier()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_ranks_save_and_load_their_shards(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    context = mp.start_processes(
        _save_and_load, args=(str(tmp_path), _free_port(), errors), nprocs=WORLD_SIZE, join=False, start_method="spawn"
    )
    try:
        while not context.join(timeout=120):
            pass
    except Exception as failure:
        reports = []
        while not errors.empty():
            reports.append(errors.get())
        raise AssertionError("\n".join(f"rank {r}:\n{tb}" for r, tb in reports) or str(failure)) from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    assert sorted(os.listdir(tmp_path / "step_00000003")) == [
        "manifest.json", "meta.json",
        "rank_00000.json", "rank_00000.safetensors", "rank_00001.json", "rank_00001.safetensors",
    ]
