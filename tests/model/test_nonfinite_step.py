"""A non-finite loss skips the whole step: no optimizer, router-statistic or multiplier update."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute


def _worker(rank, world_size):
    import megatron_triroute.training.engine as engine_mod
    from megatron_triroute.training.engine import MicroBatch, TrainEngine

    cfg = tiny_triroute()
    model, groups = build(cfg, seed=6)
    engine = TrainEngine(model, groups, torch.optim.AdamW(model.parameters(), lr=1e-2), total_steps=10)
    tokens, labels, idx = batch(cfg, n=2, seed=2)
    mbs = [MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)]
    engine.train_step(mbs, 0)  # one good step so every statistic has moved once
    state = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    optimizer_steps = engine.optimizer.state[next(iter(model.parameters()))]["step"].clone()

    good_loss = engine_mod._loss
    engine_mod._loss = lambda out, mb: good_loss(out * float("nan"), mb)
    try:
        report = engine.train_step(mbs, 1)
    finally:
        engine_mod._loss = good_loss
    assert report.skipped and report.loss != report.loss  # nan
    after = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    for name, value in state.items():  # parameters, whitening, rho, lambda, EMA: all untouched
        assert torch.equal(value, after[name]), name
    assert torch.equal(engine.optimizer.state[next(iter(model.parameters()))]["step"], optimizer_steps)
    assert model.router_statistics.sums.abs().sum() == 0 and model.budget._acc.abs().sum() == 0
    from megatron_triroute.routing.running_stats import running_statistics

    stats = running_statistics([model])
    assert stats and all(stat.pending().abs().sum() == 0 for stat in stats)  # accumulators dropped
    report = engine.train_step(mbs, 2)  # and training goes on
    assert not report.skipped and report.loss == report.loss


@pytest.mark.distributed
def test_nonfinite_loss_skips_the_step_entirely():
    run_distributed(_worker, 1)


def _adam_steps(engine) -> list[torch.Tensor]:
    """Every AdamW state's step count (the distributed optimizer: of this rank's shards)."""
    inner = getattr(engine.optimizer, "inner", None)
    states = [engine.optimizer.state] if inner is None else [opt.optimizer.state for opt in inner]
    return [s["step"].clone() for state in states for s in state.values()]


def _snapshot(model, engine):
    state = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    return state, _adam_steps(engine)


def _assert_untouched(model, engine, before, what):
    from megatron_triroute.routing.running_stats import running_statistics

    state, steps = before
    after = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    for name, value in state.items():
        assert torch.equal(value, after[name]), (what, name)
    assert steps and _adam_steps(engine) == steps, what
    assert model.router_statistics.sums.abs().sum() == 0 and model.budget._acc.abs().sum() == 0, what
    assert all(stat.pending().abs().sum() == 0 for stat in running_statistics([model])), what


def _same_on_every_rank(t: torch.Tensor) -> bool:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(parts[0], p) for p in parts)


def _two_rank_worker(rank, world_size, engine_name="torch"):
    """Data parallel 2 with expert parallel 2 (each rank holds its own experts, expert-data
    parallel 1, so an expert gradient is never all-reduced): a NaN on rank 1 only, in the loss, in
    one of its expert gradients, or in a dense gradient, makes both ranks skip the whole step.
    `engine_name="distopt"`: Megatron's distributed optimizer, where each rank sees only its shard
    of the dense gradients (the NaN may sit in the other rank's shard); "distopt_bf16": the same
    with bf16 matrices and gradient buckets over fp32 master shards (bf16 forward), whose masters
    stay untouched too."""
    import megatron_triroute.training.engine as engine_mod
    from megatron_triroute.training.engine import MicroBatch, TrainEngine

    cfg = tiny_triroute()
    model, groups = build(cfg, ep=2, seed=6)
    assert (groups.dp, groups.ep, groups.edp) == (2, 2, 1)
    masters = lambda: {}  # noqa: E731 - fp32 parameters are their own masters
    if engine_name.startswith("distopt"):
        from megatron_triroute.parallel.megatron_distopt import MegatronDistributedAdamW

        bf16 = engine_name == "distopt_bf16"
        named = list(model.named_parameters())
        optimizer = MegatronDistributedAdamW(
            model, [{"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
                    {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0}],
            groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, bucket_size=20000, bf16=bf16)
        engine = TrainEngine(model, groups, optimizer, total_steps=10, grad_sync=optimizer, bf16=bf16)
        masters = optimizer.master_parameters
        assert bool(masters()) == bf16
    else:
        engine = TrainEngine(model, groups, torch.optim.AdamW(model.parameters(), lr=1e-2), total_steps=10)
    tokens, labels, idx = batch(cfg, n=2, seed=2 + rank, offset=2 * rank)
    mbs = [MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)]
    assert not engine.train_step(mbs, 0).skipped  # one good step so every statistic has moved once
    named = dict(model.named_parameters())
    expert = [p for n, p in named.items() if getattr(p, "allreduce", True) is False]
    dense = [named["decoder.layers.1.self_attention.linear_proj.weight"]]
    assert expert

    def nan_loss():
        good = engine_mod._loss
        if rank == 1:
            engine_mod._loss = lambda out, mb: good(out * float("nan"), mb)
        return lambda: setattr(engine_mod, "_loss", good)

    def nan_grads(params):
        def install():
            handles = [p.register_hook(lambda g: g * float("nan")) for p in params] if rank == 1 else []
            return lambda: [h.remove() for h in handles]
        return install

    for step, (what, inject) in enumerate(
            (("loss", nan_loss), ("expert gradient", nan_grads(expert)), ("dense gradient", nan_grads(dense))), 1):
        before, masters_before = _snapshot(model, engine), masters()
        undo = inject()
        try:
            report = engine.train_step(mbs, step)
        finally:
            undo()
        assert report.skipped, (what, rank, report)
        assert _same_on_every_rank(torch.tensor([float(report.skipped)])), what
        _assert_untouched(model, engine, before, f"{what} (rank {rank})")
        assert all(torch.equal(m, masters_before[k]) for k, m in masters().items()), what
    report = engine.train_step(mbs, 4)  # and training goes on, on both ranks alike
    assert not report.skipped and report.loss == report.loss
    for name, p in named.items():
        if getattr(p, "allreduce", True):
            assert _same_on_every_rank(p.detach()), name


@pytest.mark.distributed
@pytest.mark.parametrize("engine_name", ["torch", "distopt", "distopt_bf16"])
def test_nan_on_one_of_two_ranks_skips_the_step_on_both(engine_name):
    run_distributed(_two_rank_worker, 2, engine_name, timeout=240)
