"""Two gloo processes save and load their own shards, and one rank reads the other's (re-sharding)."""

import os

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed


def _rank_state(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return {
        "model": {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen).to(torch.bfloat16)},
        "data": {"rank": rank, "consumed": step * 8},
    }


def _save_and_load(rank: int, world_size: int, root: str) -> None:
    import torch.distributed as dist

    from megatron_triroute.checkpoint import list_checkpoints, load_checkpoint, load_shards, save_checkpoint
    from megatron_triroute.training.signals import request_stop, stop_agreed, torch_all_reduce_max

    for step in (1, 2, 3):
        save_checkpoint(
            root, step, _rank_state(rank, step), {"step": step, "world": world_size},
            rank=rank, world_size=world_size, barrier=dist.barrier, keep_last=2,
        )
    assert [c.step for c in list_checkpoints(root)] == [2, 3]
    step, state, meta = load_checkpoint(root, rank, world_size=world_size)
    assert (step, meta) == (3, {"step": 3, "world": world_size})
    expected = _rank_state(rank, 3)
    assert state["data"] == expected["data"]
    for key in ("w", "b"):
        assert state["model"][key].equal(expected["model"][key])
    # Re-sharding: any rank can read every shard and merge.
    _, shards, _ = load_shards(root, step=2)
    for other in range(world_size):
        assert shards[other]["model"]["w"].equal(_rank_state(other, 2)["model"]["w"])

    # Stop agreement: a signal seen by rank 1 only stops both ranks at the same step.
    reduce_max = torch_all_reduce_max()
    assert stop_agreed(reduce_max) is False
    if rank == 1:
        request_stop()
    assert stop_agreed(reduce_max) is True
    dist.barrier()


def test_two_ranks_save_and_load_their_shards(tmp_path):
    run_distributed(_save_and_load, 2, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000002", "step_00000003"]
    assert sorted(os.listdir(tmp_path / "step_00000003")) == [
        "manifest.json", "meta.json",
        "rank_00000.json", "rank_00000.safetensors", "rank_00001.json", "rank_00001.safetensors",
    ]
