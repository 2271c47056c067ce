"""Layout-independent model checkpoints: written at one (TP, EP, PP) layout, loaded at another,
the model computes the same losses; an EP=2 checkpoint holds every expert exactly once; a
checkpoint missing a shard is refused naming the tensor."""

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


def _worker(rank, world_size, root, layouts, missing_from=None):
    import pickle
    import shutil

    import torch.distributed as dist

    from megatron_triroute.checkpoint import CheckpointError
    from megatron_triroute.checkpoint.sharded import load_model, read_metadata, save_model
    from megatron_triroute.parallel import destroy_parallel

    cfg = tiny_triroute()
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
        if not dst and rank == 0:  # one process, no torch.distributed: the whole 1/1/1 model
            from megatron_triroute.checkpoint.sharded import full_model_state

            full = full_model_state(directory)
            mine = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
            assert sorted(full) == sorted(mine), set(full) ^ set(mine)
            for key, value in mine.items():
                assert torch.equal(full[key], value), key
        destroy_parallel()
        assert abs(got - expected) < 1e-5, (src, dst, got, expected)
        assert abs(fresh - expected) > 1e-3, (src, dst)  # the check can fail
        dist.barrier()
    if missing_from is None:
        return
    # A checkpoint missing one expert chunk (as if a rank's shard never got written) is refused.
    source, broken = f"{root}/ckpt_{missing_from}", f"{root}/missing"
    if rank == 0:
        shutil.copytree(source, broken)
        meta = read_metadata(broken)
        key = sorted(k for k in meta.state_dict_metadata if ".moe.experts." in k)[0]
        meta.state_dict_metadata[key].chunks.pop()
        with open(f"{broken}/.metadata", "wb") as handle:
            pickle.dump(meta, handle)
    dist.barrier()
    model, groups = build(cfg, seed=5)
    with pytest.raises(CheckpointError) as error:
        load_model(broken, model)
    assert ".moe.experts." in str(error.value) and "elements stored" in str(error.value), str(error.value)
    destroy_parallel()


LAYOUTS_2 = [  # a target of {} (1/1/1) also checks the one-process full reader
    (dict(tp=2), dict()), (dict(tp=1), dict(tp=2)), (dict(ep=2), dict(ep=1)), (dict(ep=1), dict(ep=2)),
    (dict(pp=2), dict()), (dict(tp=2, ep=2), dict()),
]


def test_checkpoints_load_across_layouts_on_two_ranks(tmp_path):
    from megatron_triroute.checkpoint.sharded import coverage_problems, read_metadata

    run_distributed(_worker, 2, str(tmp_path), LAYOUTS_2, 2, timeout=400)
    # The EP=2 checkpoint (layout pair 2) holds every (layer, expert) of every weight exactly once.
    meta = read_metadata(tmp_path / "ckpt_2")
    cfg = tiny_triroute()
    expert_keys = [k for k in meta.state_dict_metadata if ".moe.experts." in k]
    assert sorted(k.rsplit(".", 2)[-2] for k in expert_keys) == ["w1", "w2", "w3"]
    for key in expert_keys:
        entry = meta.state_dict_metadata[key]
        layers, experts = entry.size[0], entry.size[1]
        assert (layers, experts) == (cfg.model.n_layers, cfg.router.num_experts), key
        cells = sorted((c.offsets[0] + i, c.offsets[1] + j) for c in entry.chunks
                       for i in range(c.sizes[0]) for j in range(c.sizes[1]))
        assert cells == [(l, e) for l in range(layers) for e in range(experts)], key
    assert coverage_problems(meta) == []


def test_ep2_to_ep4_on_four_ranks(tmp_path):
    run_distributed(_worker, 4, str(tmp_path), [(dict(ep=2), dict(ep=4))], timeout=400)


def test_metadata_with_a_foreign_class_is_refused(tmp_path):
    import pickle

    from megatron_triroute.checkpoint import CheckpointError
    from megatron_triroute.checkpoint.sharded import read_metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps({"x": __import__("collections").Counter()}))
    with pytest.raises(CheckpointError, match="collections.Counter"):
        read_metadata(tmp_path)
