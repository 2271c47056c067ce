"""Single-process checkpoint behaviour: exact round trips, verification and fallback, crash safety,
pruning. Multi-rank saving is in test_checkpoint_distributed.py."""

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_triroute.checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    NoVerifiedCheckpointError,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_shards,
    save_checkpoint,
)
from megatron_triroute.checkpoint.store import (CRASH_ENV, CRASH_EXIT_CODE, SET_ASIDE_MARK, checksum_share,
                                                set_aside_all, verify_checkpoint)

REPO = Path(__file__).resolve().parents[2]
LOGGER = "megatron_triroute.checkpoint.store"


def sample_tree(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embed.weight": torch.randn(5, 3, generator=gen),  # a dotted key, as in module state dicts
            "layers": {"0": {"w": torch.randn(3, 3, generator=gen, dtype=torch.float64)}},
            "bf16": torch.randn(4, generator=gen).to(torch.bfloat16),
            "fp16": torch.randn(2, 2, generator=gen).to(torch.float16),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, generator=gen)}},
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": [0]}],
        },
        "ints": {"i8": torch.tensor([-128, 127], dtype=torch.int8), "u8": torch.arange(4, dtype=torch.uint8)},
        "u16": torch.tensor([0, 65535], dtype=torch.int32).to(torch.uint16),
        "fp8": torch.randn(6, generator=gen).to(torch.float8_e4m3fn),
        "complex": torch.randn(2, generator=gen, dtype=torch.complex64),
        "i32": torch.tensor([2**31 - 1], dtype=torch.int32),
        "i64": torch.tensor([2**62, -(2**62)]),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
        "step": 12,
        "lr": 1e-3,
        "name": "tiny",
        "nothing": None,
        "flag": True,
        "not_a_number": float("nan"),
        "pair": (1, "two"),
        "list_of_tensors": [torch.ones(2), torch.zeros(1, dtype=torch.int16)],
    }


def assert_trees_equal(actual, expected, path="root"):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        # Bit-exact: compare raw bytes, not values (NaN != NaN, -0.0 == 0.0).
        assert actual.reshape(-1).view(torch.uint8).equal(expected.reshape(-1).view(torch.uint8)), path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), path
        for key in expected:
            assert_trees_equal(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_trees_equal(a, e, f"{path}[{i}]")
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, path  # NaN
    else:
        assert type(actual) is type(expected) and actual == expected, path


def test_round_trip_is_bit_exact(tmp_path):
    tree = sample_tree()
    meta = {"config": {"d_model": 64}, "data": {"epoch": 1, "offset": 4096}, "scheduler": {"last_epoch": 12}}
    path = save_checkpoint(tmp_path, 12, tree, meta)
    assert path == tmp_path / "step_00000012"
    assert (tmp_path / "latest").read_text() == "step_00000012\n"
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json", "meta.json", "rank_00000.json", "rank_00000.safetensors",
    ]
    step, loaded, loaded_meta = load_checkpoint(tmp_path, rank=0, world_size=1)
    assert step == 12 and loaded_meta == meta
    assert_trees_equal(loaded, tree)


def test_manifest_records_every_file(tmp_path):
    path = save_checkpoint(tmp_path, 3, {"w": torch.ones(2)}, {"a": 1})
    manifest = json.loads((path / "manifest.json").read_text())
    assert (manifest["step"], manifest["world_size"], manifest["format_version"]) == (3, 1, 1)
    assert sorted(manifest["files"]) == ["meta.json", "rank_00000.json", "rank_00000.safetensors"]
    for name, record in manifest["files"].items():
        assert record["bytes"] == (path / name).stat().st_size and len(record["sha256"]) == 64


def test_rejects_non_json_meta_and_leaves(tmp_path):
    with pytest.raises(TypeError, match="meta"):
        save_checkpoint(tmp_path, 1, {}, {"bad": object()})
    with pytest.raises(TypeError, match="numpy|neither a tensor"):
        save_checkpoint(tmp_path, 1, {"x": {"y": b"bytes"}}, {})
    assert not (tmp_path / "latest").exists()


def test_no_checkpoint_is_a_clear_error(tmp_path):
    assert latest_valid_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint under"):
        load_checkpoint(tmp_path)


def _two_checkpoints(root):
    save_checkpoint(root, 100, sample_tree(1), {"step": 100})
    save_checkpoint(root, 200, sample_tree(2), {"step": 200})
    return root / "step_00000200"


def _flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped byte in shard": (
        lambda d: _flip_byte(d / "rank_00000.safetensors", -3),
        "rank_00000.safetensors sha256 does not match",
    ),
    "truncated shard": (
        lambda d: os.truncate(d / "rank_00000.safetensors", 100),
        "rank_00000.safetensors is 100 bytes, manifest says",
    ),
    "truncated skeleton": (lambda d: os.truncate(d / "rank_00000.json", 0), "rank_00000.json is 0 bytes"),
    "deleted manifest": (lambda d: (d / "manifest.json").unlink(), "manifest.json is missing"),
    "garbled manifest": (lambda d: (d / "manifest.json").write_text("{"), "manifest.json is unreadable"),
    "deleted shard": (lambda d: (d / "rank_00000.safetensors").unlink(), "rank_00000.safetensors is missing"),
    "deleted directory": (lambda d: __import__("shutil").rmtree(d), "directory is missing"),
}


@pytest.mark.parametrize("damage", CORRUPTIONS, ids=list(CORRUPTIONS))
def test_corrupted_latest_falls_back_with_warning(tmp_path, caplog, damage):
    corrupt, expected_problem = CORRUPTIONS[damage]
    corrupt(_two_checkpoints(tmp_path))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        step, tree, meta = load_checkpoint(tmp_path)
    assert (step, meta) == (100, {"step": 100})
    assert_trees_equal(tree, sample_tree(1))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step_00000200" in w and expected_problem in w for w in warnings), warnings
    assert any("falling back to checkpoint" in w and "step_00000100" in w for w in warnings), warnings


def test_garbage_latest_pointer_uses_newest_valid(tmp_path, caplog):
    _two_checkpoints(tmp_path)
    (tmp_path / "latest").write_text("\x00garbage")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert load_checkpoint(tmp_path)[0] == 200
    assert "not a step directory name" in caplog.text


def test_every_checkpoint_corrupt_raises(tmp_path, caplog):
    _two_checkpoints(tmp_path)
    for step in (100, 200):
        _flip_byte(tmp_path / f"step_{step:08d}" / "rank_00000.safetensors", 50)
    with pytest.raises(CheckpointNotFoundError, match="no valid checkpoint.*step_00000200.*step_00000100"):
        load_checkpoint(tmp_path)


def test_explicit_step_does_not_fall_back(tmp_path):
    _flip_byte(_two_checkpoints(tmp_path) / "rank_00000.safetensors", -1)
    assert load_checkpoint(tmp_path, step=100)[0] == 100
    with pytest.raises(CheckpointError, match="step_00000200 is unusable: rank_00000.safetensors sha256"):
        load_checkpoint(tmp_path, step=200)


def test_keep_last_prunes_but_keeps_latest(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, {"w": torch.full((2,), float(step))}, {}, keep_last=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [30, 40]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000030", "step_00000040"]
    save_checkpoint(tmp_path, 50, {}, {}, keep_last=1)
    assert [c.step for c in list_checkpoints(tmp_path, verify=True)] == [50]
    assert load_checkpoint(tmp_path)[0] == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000050"]  # verified, superseded


def test_resume_from_older_sets_aside_abandoned_newer_checkpoints(tmp_path, caplog):
    # 300 got corrupted, the run resumed from 200 and now saves 250: 300 belongs to a dead timeline,
    # but it is set aside (its bytes kept for the user), not deleted.
    for step in (100, 200, 300):
        save_checkpoint(tmp_path, step, {"w": torch.tensor([float(step)])}, {})
    _flip_byte(tmp_path / "step_00000300" / "rank_00000.safetensors", -1)
    assert load_checkpoint(tmp_path)[0] == 200
    save_checkpoint(tmp_path, 250, {"w": torch.tensor([250.0])}, {}, keep_last=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [200, 250]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("step_00000300" + SET_ASIDE_MARK)]
    assert len(aside) == 1 and (aside[0] / "rank_00000.safetensors").is_file()


def test_every_checkpoint_corrupt_is_refused_and_nothing_is_deleted(tmp_path):
    _two_checkpoints(tmp_path)
    _flip_byte(tmp_path / "step_00000100" / "rank_00000.safetensors", 50)
    (tmp_path / "step_00000200" / "manifest.json").write_text(
        (tmp_path / "step_00000200" / "manifest.json").read_text().replace('"format_version": 1', '"format_version": 9'))
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(NoVerifiedCheckpointError, match="step_00000200: format_version 9.*step_00000100: "
                       "rank_00000.safetensors sha256.*Nothing was deleted.*train.start_fresh=true"):
        latest_valid_checkpoint(tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_latest_naming_a_missing_checkpoint_is_refused(tmp_path):
    _two_checkpoints(tmp_path)
    for step in (100, 200):
        shutil.rmtree(tmp_path / f"step_{step:08d}")
    with pytest.raises(NoVerifiedCheckpointError, match="step_00000200: directory is missing"):
        latest_valid_checkpoint(tmp_path)


def test_prune_sets_aside_an_old_checkpoint_that_fails_verification(tmp_path):
    for step in (10, 20):
        save_checkpoint(tmp_path, step, {"w": torch.full((4,), float(step))}, {})
    shard = tmp_path / "step_00000010" / "rank_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])  # truncated: not a whole superseded copy
    save_checkpoint(tmp_path, 30, {"w": torch.full((4,), 30.0)}, {}, keep_last=1)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "step_00000020" not in names  # verified and superseded: removed
    assert [n for n in names if n.startswith("step_00000010" + SET_ASIDE_MARK)]  # kept aside
    assert [c.step for c in list_checkpoints(tmp_path)] == [30]


def test_set_aside_all_keeps_every_byte_and_starts_the_root_fresh(tmp_path):
    _two_checkpoints(tmp_path)
    moved = set_aside_all(tmp_path, "starting fresh on purpose")
    assert len(moved) == 2 and all((m / "manifest.json").is_file() for m in moved)
    assert latest_valid_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 1, {"w": torch.ones(1)}, {}, keep_last=1)  # the set-aside ones stay
    assert all(m.is_dir() for m in moved)


def test_each_file_is_hashed_once_across_shares_and_once_per_process(tmp_path, monkeypatch):
    import megatron_triroute.durability as durability

    path = _two_checkpoints(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    hashed = []
    real = durability.sha256_file
    monkeypatch.setattr(durability, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real(p, *a))
    for k in range(3):  # three ranks, each its share
        assert verify_checkpoint(path, 200, share=(k, 3))[0] is None
    assert sorted(hashed) == sorted(manifest["files"])
    hashed.clear()
    assert verify_checkpoint(path, 200)[0] is None and len(hashed) == len(manifest["files"])
    hashed.clear()
    assert load_checkpoint(tmp_path)[0] == 200 and hashed == []  # unchanged since: stats only
    _flip_byte(path / "rank_00000.safetensors", 60)  # rewritten in place: its mtime moves
    os.utime(path / "rank_00000.safetensors", ns=(1, 1))
    assert "sha256" in verify_checkpoint(path, 200)[0]
    # a share that does not hold the corrupt file passes; the one that does finds it
    holder = int("rank_00000.safetensors" not in checksum_share(manifest["files"], 0, 2))
    assert verify_checkpoint(path, 200, share=(1 - holder, 2))[0] is None
    assert "sha256" in verify_checkpoint(path, 200, share=(holder, 2))[0]


def test_checksum_shares_split_the_bytes_evenly_and_cover_every_file_once():
    files = {"a": {"bytes": 10}, "b": {"bytes": 10}, "c": {"bytes": 1}, "d": {"bytes": 1}, "e": {"bytes": 0}}
    shares = [checksum_share(files, k, 2) for k in range(2)]
    assert shares == [["a", "c", "e"], ["b", "d"]]  # by hand: a->0, b->1, c->0 (tie: lowest), d->1, e->0
    assert sorted(shares[0] + shares[1]) == sorted(files)
    assert checksum_share(files, 0, 1) == sorted(files)


def test_resaving_a_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 5, {"w": torch.tensor([1.0])}, {"v": 1})
    save_checkpoint(tmp_path, 5, {"w": torch.tensor([2.0])}, {"v": 2})
    step, tree, meta = load_checkpoint(tmp_path)
    assert (step, tree["w"].item(), meta) == (5, 2.0, {"v": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000005"]


def test_world_size_mismatch_points_to_load_shards(tmp_path):
    save_checkpoint(tmp_path, 1, {"w": torch.ones(1)}, {})
    with pytest.raises(CheckpointError, match="load_shards"):
        load_checkpoint(tmp_path, rank=0, world_size=2)
    with pytest.raises(CheckpointError, match="asked for rank 1"):
        load_checkpoint(tmp_path, rank=1)


CRASHING_SAVE = textwrap.dedent(
    """
    import sys, torch
    from megatron_triroute.checkpoint import save_checkpoint
    save_checkpoint(sys.argv[1], int(sys.argv[2]), {"w": torch.full((1000,), 2.0), "n": 2}, {"step": 2})
    print("save returned", flush=True)
    """
)


@pytest.mark.parametrize("phase", ["after_shard", "before_rename", "before_latest"])
def test_save_killed_midway_keeps_previous_latest(tmp_path, caplog, phase):
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, {"w": torch.full((1000,), 1.0), "n": 1}, {"step": 1})
    environ = dict(os.environ, PYTHONPATH=str(REPO), **{CRASH_ENV: phase})
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVE, str(root), "2"], env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == CRASH_EXIT_CODE, done.stdout + done.stderr
    assert "save returned" not in done.stdout
    assert (root / "latest").read_text() == "step_00000001\n"
    leftover = root / (".tmp-step_00000002" if phase != "before_latest" else "step_00000002")
    assert leftover.is_dir()

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        step, tree, meta = load_checkpoint(root)
    assert (step, tree["n"], meta) == (1, 1, {"step": 1})
    assert tree["w"].eq(1.0).all()
    if phase == "before_latest":  # complete on disk but never committed
        assert "ignoring step_00000002" in caplog.text

    # The next save (the resumed run reaching step 2 again) cleans up and commits.
    save_checkpoint(root, 2, {"w": torch.full((1000,), 3.0), "n": 3}, {"step": 2})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    step, tree, _ = load_checkpoint(root)
    assert (step, tree["n"]) == (2, 3)


def test_load_shards_single(tmp_path):
    save_checkpoint(tmp_path, 4, {"w": torch.ones(2)}, {"m": 1})
    step, shards, meta = load_shards(tmp_path)
    assert step == 4 and list(shards) == [0] and meta == {"m": 1}
    assert shards[0]["w"].equal(torch.ones(2))


@pytest.mark.parametrize("step,expected", [("aside", 1), ("swapped", 2), ("discarding", 2)])
def test_resave_killed_between_renames_never_loses_the_step(tmp_path, step, expected):
    # Re-saving a committed step swaps directories; killed between any two of the publish's
    # steps, the checkpoint `latest` names is still whole (old or new), never missing.
    from megatron_triroute import durability

    root = tmp_path / "ckpt"
    save_checkpoint(root, 2, {"w": torch.full((1000,), 1.0), "n": 1}, {"step": 2})
    environ = dict(os.environ, PYTHONPATH=str(REPO), **{durability.CRASH_ENV: step})
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVE, str(root), "2"], env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == durability.CRASH_EXIT_CODE, done.stdout + done.stderr
    assert (root / "latest").read_text() == "step_00000002\n"
    loaded_step, tree, _ = load_checkpoint(root)  # read-only: works before any repair
    assert (loaded_step, tree["n"]) == (2, expected)
    assert tree["w"].eq(float(expected)).all()

    save_checkpoint(root, 3, {"w": torch.ones(1), "n": 3}, {"step": 3})  # the next save repairs
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert load_checkpoint(root, step=2)[1]["n"] == expected
