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
    _resume_check_is_shared(rank, world_size, root)


def _resume_check_is_shared(rank: int, world_size: int, root: str) -> None:
    """A resume reads each file's bytes once over all ranks, and every rank takes the same decision."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    import torch.distributed as dist

    import megatron_triroute.durability as durability
    from megatron_triroute.checkpoint import NoVerifiedCheckpointError, load_checkpoint
    from megatron_triroute.checkpoint import store
    from megatron_triroute.training.run_state import find_resume_checkpoint

    groups = SimpleNamespace(rank=rank, world_size=world_size)
    hashed, real = [], durability.sha256_file
    durability.sha256_file = lambda path, *a: hashed.append(Path(path).name) or real(path, *a)
    store._VERIFIED.clear()
    assert find_resume_checkpoint(root, groups).step == 3
    files = json.loads((Path(root) / "step_00000003" / "manifest.json").read_text())["files"]
    assert sorted(hashed) == store.checksum_share(files, rank, world_size)
    assert set(store.checksum_share(files, 0, 2)).isdisjoint(store.checksum_share(files, 1, 2))
    hashed.clear()
    assert load_checkpoint(root, rank)[0] == 3 and hashed == []  # verified once: not read again
    dist.barrier()
    # A file only rank 1 checks is corrupt: both ranks fall back to step 2 together.
    if rank == 0:
        _flip(Path(root) / "step_00000003" / store.checksum_share(files, 1, world_size)[0])
    dist.barrier()
    store._VERIFIED.clear()
    assert find_resume_checkpoint(root, groups).step == 2
    if rank == 0:
        _flip(Path(root) / "step_00000002" / "meta.json")
    dist.barrier()
    store._VERIFIED.clear()
    try:
        find_resume_checkpoint(root, groups, full_check=True)
        raise AssertionError("a root whose checkpoints all fail verification must be refused")
    except NoVerifiedCheckpointError as error:
        assert "step_00000003" in str(error) and "step_00000002" in str(error)
    durability.sha256_file = real
    dist.barrier()


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_two_ranks_save_and_load_their_shards(tmp_path):
    run_distributed(_save_and_load, 2, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000002", "step_00000003"]
    assert sorted(os.listdir(tmp_path / "step_00000003")) == [
        "manifest.json", "meta.json",
        "rank_00000.json", "rank_00000.safetensors", "rank_00001.json", "rank_00001.safetensors",
    ]
