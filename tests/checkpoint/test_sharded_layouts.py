"""Layout-independent model checkpoints: written at one (TP, EP, PP) layout, loaded at another,
the model computes the same losses; an EP=2 checkpoint holds every expert exactly once; a
checkpoint missing a shard is refused naming the tensor."""

import math

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute

pytestmark = pytest.mark.distributed




def _eval_loss(model, groups, cfg) -> float:
    from megatron_triroute.training.engine import MicroBatch, TrainEngine

    tokens, labels, idx = batch(cfg, n=2, seed=3)
    mbs = [MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)] * groups.dp
    engine = TrainEngine(model, groups, torch.optim.SGD(model.parameters(), lr=0.0), total_steps=10)
    loss, _ = engine.evaluate(mbs)
    return loss


def _perturb(model) -> None:
    """Moves every parameter off its initial value by an amount keyed by its global position, the
    same at every layout (a sine of the value itself), so a load that put a slice in the wrong
    place changes the loss."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.sin(17.0 * p))


def _worker(rank, world_size, root, layouts):
    import torch.distributed as dist

    from megatron_triroute.checkpoint.sharded import load_model, save_model
    from megatron_triroute.parallel import destroy_parallel

    cfg = tiny_triroute()
    results = []
    for i, (src, dst) in enumerate(layouts):
        directory = f"{root}/ckpt_{i}"
        model, groups = build(cfg, **src, seed=5)
        _perturb(model)
        expected = _eval_loss(model, groups, cfg)
        save_model(directory, model)
        destroy_parallel()
        model, groups = build(cfg, **dst, seed=99)  # a different init: everything must come from the file
        fresh = _eval_loss(model, groups, cfg)
        load_model(directory, model)
        got = _eval_loss(model, groups, cfg)
        destroy_parallel()
        assert abs(got - expected) < 1e-5, (src, dst, got, expected)
        assert abs(fresh - expected) > 1e-3, (src, dst)  # the check can fail
        results.append(got)
        dist.barrier()


LAYOUTS_2 = [
    (dict(tp=2), dict(tp=1)), (dict(tp=1), dict(tp=2)), (dict(ep=2), dict(ep=1)), (dict(ep=1), dict(ep=2)),
    (dict(pp=2), dict(pp=1)), (dict(tp=2, ep=2), dict(tp=1, ep=1)),
]


def test_checkpoints_load_across_layouts_on_two_ranks(tmp_path):
    run_distributed(_worker, 2, str(tmp_path), LAYOUTS_2, timeout=400)


def test_ep2_to_ep4_on_four_ranks(tmp_path):
    run_distributed(_worker, 4, str(tmp_path), [(dict(ep=2), dict(ep=4))], timeout=400)


def _save_ep2(rank, world_size, root):
    from megatron_triroute.checkpoint.sharded import save_model

    model, _ = build(tiny_triroute(), ep=2, seed=5)
    save_model(root, model)


def _load_into_ep1(rank, world_size, root):
    from megatron_triroute.checkpoint.sharded import load_model

    model, _ = build(tiny_triroute(), ep=1, seed=5)
    load_model(root, model)


def test_ep2_checkpoint_holds_every_expert_once_and_a_missing_shard_is_refused(tmp_path):
    from megatron_triroute.checkpoint import CheckpointError
    from megatron_triroute.checkpoint.sharded import coverage_problems, read_metadata

    root = tmp_path / "ckpt"
    run_distributed(_save_ep2, 2, str(root))
    meta = read_metadata(root)
    cfg = tiny_triroute()
    expert_keys = [k for k in meta.state_dict_metadata if ".moe.experts." in k]
    assert sorted(k.rsplit(".", 2)[-2] for k in expert_keys) == ["w1", "w2", "w3"]
    for key in expert_keys:
        entry = meta.state_dict_metadata[key]
        layers, experts = entry.size[0], entry.size[1]
        assert (layers, experts) == (cfg.model.n_layers, cfg.router.num_experts), key
        cells = sorted((c.offsets[0], c.offsets[1] + j) for c in entry.chunks
                       for j in range(c.sizes[1]) for _ in range(c.sizes[0]))
        assert cells == [(l, e) for l in range(layers) for e in range(experts)], key  # each once
    assert coverage_problems(meta) == []

    # Drop one expert chunk from the metadata, as if a rank's shard never got written.
    key = expert_keys[0]
    dropped = meta.state_dict_metadata[key].chunks.pop()
    problems = coverage_problems(meta)
    assert len(problems) == 1 and key in problems[0] and str(tuple(dropped.offsets)) in str(
        [tuple(c.offsets) for c in meta.state_dict_metadata[key].chunks] + [tuple(dropped.offsets)])
    import pickle

    (root / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(AssertionError) as error:
        run_distributed(_load_into_ep1, 1, str(root))
    assert "CheckpointError" in str(error.value) and key in str(error.value)
    assert math.prod(meta.state_dict_metadata[key].size) > 0 and CheckpointError


def test_metadata_with_a_foreign_class_is_refused(tmp_path):
    import pickle

    from megatron_triroute.checkpoint import CheckpointError
    from megatron_triroute.checkpoint.sharded import read_metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps({"x": __import__("collections").Counter()}))
    with pytest.raises(CheckpointError, match="collections.Counter"):
        read_metadata(tmp_path)
