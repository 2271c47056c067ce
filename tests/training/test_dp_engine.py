"""Every data-parallel engine (parallel/dp_engine.py: DP_ENGINES, as `build_dp_engine` builds it
with the default options: for `megatron_distopt`, the default, both collectives overlapped) trains
the model the replicated oracle trains:
one flat all-reduce after the backward (`ReplicatedGradSync`) feeding torch's AdamW, every rank
holding every moment. Four clipped AdamW steps with two accumulated micro-batches per rank, on the
same batches, end with every parameter within 1e-6 and the same gradient norms, at DP2 x EP1 (with
DeepSpeed's expert dispatch and with the grouped experts), DP2 x EP2, TP2 x EP2 and PP2 x DP2 x EP2.

The trainer-level runs of the engine (checkpoints, resume across layouts, the bf16 masters) are in
tests/training/test_resume_layouts.py and below."""

from pathlib import Path

import pytest
import torch

from megatron_triroute.checkpoint.sharded import full_model_state
from tests.dist_utils import run_distributed

from .conftest import log_text, run_to_end, steps

pytestmark = pytest.mark.distributed

STEPS = 4
TOL = 1e-6
CLIP = 0.05
"""Below every step's gradient norm here (about 0.8), so every update is clipped by the norm
each engine computes."""
# eps 1e-3: with 1e-8 an element whose gradient is rounding noise moves by about +-lr whatever the
# noise's sign, so a last-bit difference in a reduced gradient (the two engines sum in other
# orders when a bucket boundary splits a flat buffer) could show as ~lr in a weight.
OPTIM = ["optim.lr=1e-2", "optim.eps=1e-3", "optim.weight_decay=0.1", f"optim.clip_grad={CLIP}",
         "parallel.bucket_mb=0.01"]  # 0.01 MB buckets: many, most reduced while the backward still runs


def _train(rank: int, world: int, layout: dict, engine_name: str) -> tuple[dict, list[float]]:
    """STEPS steps of the harness model on this rank's share of each global batch; returns this
    rank's parameters and the logged gradient norms."""
    from megatron_triroute.parallel import destroy_parallel
    from megatron_triroute.parallel.dp_engine import adamw_groups, build_dp_engine
    from megatron_triroute.training.config import apply_overrides
    from megatron_triroute.training.engine import MicroBatch, TrainEngine
    from megatron_triroute.training.recipes import get_recipe
    from tests.model.harness import batch, build, tiny_triroute

    layout = dict(layout)
    cfg = tiny_triroute(**layout.pop("router", {}))
    model, groups = build(cfg, **layout, seed=3)
    run = apply_overrides(get_recipe("tiny"), OPTIM)
    o = run.optim
    if engine_name == "oracle":
        optimizer = torch.optim.AdamW([{"params": [p for _, p in g["params"]], "weight_decay": g["weight_decay"]}
                                       for g in adamw_groups(model, o.weight_decay)],
                                      lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        engine = TrainEngine(model, groups, optimizer, STEPS, o.clip_grad)  # grad_sync: the flat all-reduce
    else:
        run.parallel.dp_engine = engine_name
        assert run.parallel.overlap_grad_reduce and run.parallel.overlap_param_gather  # the defaults
        optimizer, grad_sync = build_dp_engine(model, run, groups)
        engine = TrainEngine(model, groups, optimizer, STEPS, o.clip_grad, grad_sync=grad_sync)
    norms = []
    for step in range(STEPS):
        mbs = []
        for micro in range(2):  # two micro-batches per data-parallel rank: accumulated under no_sync
            first = (step * groups.dp * 2 + groups.dp_rank * 2 + micro) * 2  # global sample index
            tokens, labels, idx = batch(cfg, n=2, seed=first, offset=first)
            mbs.append(MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx))
        report = engine.train_step(mbs, step)
        assert not report.skipped
        norms.append(report.grad_norm)
    if engine_name != "oracle":
        optimizer.sync_params()  # the last all-gather is pending until the next forward
    params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    destroy_parallel()
    return params, norms


def _compare(rank: int, world: int, layout: dict) -> None:
    from megatron_triroute.parallel.dp_engine import DP_ENGINES

    oracle, oracle_norms = _train(rank, world, layout, "oracle")
    assert all(n > CLIP for n in oracle_norms), oracle_norms  # every step clips
    for name in DP_ENGINES:
        got, norms = _train(rank, world, layout, name)
        assert norms == pytest.approx(oracle_norms, rel=1e-6), name
        assert sorted(got) == sorted(oracle)
        diff = max((got[n] - oracle[n]).abs().max().item() for n in oracle)
        print(f"rank {rank}: max |{name} - replicated oracle| over {len(oracle)} parameters after "
              f"{STEPS} clipped steps: {diff:.3g} (norms {['%.3f' % n for n in norms]})")
        assert diff <= TOL, name


@pytest.mark.parametrize("nproc, layout", [
    (2, {"ep": 1}),              # DP2 x EP1
    # the grouped experts read their weights without calling the expert modules: the parameter
    # all-gather the distributed optimizer overlaps with the next forward must still be waited for
    (2, {"ep": 1, "router": {"expert_compute": "grouped"}}),
    (2, {"ep": 2}),              # DP2 x EP2 (EDP1)
    (4, {"tp": 2, "ep": 2}),     # TP2 x EP2 (x DP2, EDP2)
    (4, {"pp": 2, "ep": 2}),     # PP2 x DP2 x EP2 (1F1B)
], ids=["dp2-ep1", "dp2-ep1-grouped-experts", "dp2-ep2", "tp2-ep2", "pp2-dp2-ep2"])
def test_every_engine_equals_the_replicated_oracle(nproc, layout):
    run_distributed(_compare, nproc, layout, timeout=300)


def _run(run: Path, data: Path, nproc: int, extra: list[str]) -> None:
    common = [f"train.steps={STEPS}", "triroute.model.n_kv_heads=2", "optim.eps=1e-3", "train.global_batch_size=8"]
    assert run_to_end(run, data, nproc=nproc, extra=common + extra) == 0, log_text(run)[-3000:]


def _params(run: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return full_model_state(run / "checkpoints" / f"step_{step:08d}" / "sharded")


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    # the end-of-run prices are a bisection's output, calibrated after training
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if k != "budget.prices")


def test_bf16_distributed_optimizer_resumes_exactly_from_its_fp32_masters(tiny_data, tmp_path):
    """`parallel.grad_reduce_dtype=bf16` (DP2 x EP2, bf16 forward): bf16 matrices and gradient
    buckets, fp32 master shards. Its checkpoints store the masters in fp32, so a run stopped at
    step 2 and resumed ends at step 4 with exactly the uninterrupted run's parameters (a checkpoint
    of the bf16 values would move them by ~1e-4, measured 4.8e-4). Its updates differ from fp32
    parameters under bf16 autocast by rounding only: losses within 2e-3, parameters within 5e-3
    after 4 steps (measured 3e-4 and 8e-4); the exact arithmetic is checked in
    tests/parallel/test_megatron_distopt.py."""
    low = ["parallel.expert=2", "train.bf16=true", "train.save_interval_steps=2"]
    bf16 = low + ["parallel.grad_reduce_dtype=bf16"]
    reference, uninterrupted, resumed = tmp_path / "fp32", tmp_path / "bf16", tmp_path / "resumed"
    _run(reference, tiny_data, 2, low)
    _run(uninterrupted, tiny_data, 2, bf16)
    for _ in range(2):
        _run(resumed, tiny_data, 2, bf16 + ["train.exit_interval=2"])
    assert "resumed from step 2" in log_text(resumed)
    assert "gradients in bfloat16+float32" in log_text(uninterrupted)
    assert "bf16 parameters, stepped as fp32 master shards" in log_text(uninterrupted)
    params = _params(uninterrupted)
    assert {v.dtype for v in params.values() if v.is_floating_point()} == {torch.float32, torch.float64}  # no bf16
    assert _max_abs_diff(_params(resumed), params) == 0.0
    got, ref = steps(uninterrupted), steps(reference)
    for s in range(STEPS):
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], abs=2e-3), s
    diff = _max_abs_diff(params, _params(reference))
    print(f"max |bf16 distributed optimizer - fp32 parameters| after {STEPS} steps: {diff:.3g}")
    assert 0 < diff <= 5e-3
