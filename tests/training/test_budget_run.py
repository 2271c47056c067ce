"""Short TriRoute runs meet their budget where it matters, the deployed noise-free policy on data
its prices were not calibrated on, for three seeds; an inactive budget lets its multiplier decay to
zero and never raises spending; the per-step swing of the training policy at the end is reported
(its damping is tested deterministically in tests/routing/test_budget.py).

The checks do not depend on one floating-point trajectory or on where an oscillation stopped: the
end-of-training calibration bisects prices on the last training batches to the target, and the
calibrated policy is then measured, on the hard path, on other training batches (the same
distribution: what the calibration promises, target + 0.01) and on the held-out split (another
sample of documents: see HELD_OUT_SHIFT)."""

import json
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import TINY_OVERRIDES, log_text, run_to_end

TOLERANCE = 0.01
"""The matched-budget protocol's slack on a target (README, docs/results.md)."""
HELD_OUT_SHIFT = 0.03
"""How far the held-out split's realised fractions may sit from the target. The tiny corpus holds out
11 documents; the calibrated policy's cost on them differs from its cost on training text by the
documents' mix, not by sampling: seed 0's memory fraction is 0.418 on 8 and on 64 held-out
micro-batches, 0.400 on the 8 calibration micro-batches and 0.405 on 64 other training ones."""

STEPS = 200
SHAPE = [o for o in TINY_OVERRIDES if not o.startswith(("train.global_batch_size", "train.micro_batch_size",
                                                        "train.log_interval", "train.eval_batches"))]
COMMON = [f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=8", "train.eval_batches=8",
          "train.save_interval_steps=100000", "optim.warmup_steps=10", "train.log_interval=50"]


def _run(tmp_path, tiny_data, name, extra):
    run = tmp_path / name
    code = run_to_end(run, tiny_data, extra=COMMON + extra, overrides=SHAPE, timeout=600)
    assert code == 0, log_text(run)[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    first = json.loads((run / "steps.jsonl").read_text().splitlines()[0])
    return summary, first, run


def _realised_on_other_training_batches(run, tiny_data) -> tuple[float, float]:
    """The calibrated policy's realised (FLOPs, memory) fractions on the hard path (the inference
    engine's cost audit) over the first 16 training batches: the same distribution as the last 8
    the prices were calibrated on, none of them."""
    from megatron_triroute.evaluation.loading import load_for_evaluation
    from megatron_triroute.evaluation.perplexity import evaluate_sets, run_config

    with warnings.catch_warnings():  # Megatron's import-time notices about optional GPU packages
        warnings.simplefilter("ignore")
        from megatron_triroute.training import data as data_mod

    loaded = load_for_evaluation(run / "checkpoints", tiny_data)
    config = run_config(loaded)
    config.output_dir = str(run)  # the run's dataset index cache
    train, _ = data_mod.build_datasets(config, loaded.eod, config.triroute.model.vocab_size)
    assert config.train.global_batch_size == config.train.micro_batch_size  # one micro-batch per step
    batches = [mb for step in range(16) for mb in data_mod.micro_batches(train, step, config, 0, 1)]
    (result,) = evaluate_sets(loaded.model, {"training": batches})
    return result.realised_flops, result.realised_mem


@pytest.fixture(scope="module")
def seed_runs(tiny_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("budget_runs")
    with ThreadPoolExecutor(2) as pool:  # two trainer processes at a time on a 2-core machine
        jobs = [pool.submit(_run, tmp, tiny_data, f"seed{s}", [f"triroute.seed={s}"]) for s in range(3)]
        jobs.append(pool.submit(_run, tmp, tiny_data, "loose", [
            "triroute.budget.flops_target=1.0", "triroute.budget.mem_target=1.0", "triroute.budget.lambda_init=0.3"]))
        return [j.result() for j in jobs]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_calibrated_policy_meets_each_active_target_on_data_it_was_not_calibrated_on(seed_runs, tiny_data, seed):
    summary, first, run = seed_runs[seed]
    targets = (summary["target_flops"], summary["target_mem"])
    # Both constraints bind: the unpriced policy starts above them and the multipliers are positive.
    assert first["realised"][0] > targets[0] + 0.05 and first["realised"][1] > targets[1] + 0.02, first
    # ... and the multipliers price both through the run's second half (the end value alone can sit at 0
    # in a swing: the dual ascent oscillates around the target, see the swing test below).
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    late = [s["lambdas"] for s in steps if s["step"] > STEPS // 2] + [summary["lambdas"]]
    assert all(max(lam[r] for lam in late) > 0 for r in range(2)), late
    # The calibration met the targets on its training batches (feasible side of the bisection).
    # (`calibration["active"]` is the multiplier's sign at the last step, a point of the swing: a resource
    # it calls inactive is still priced down to its target when above it, which is what is checked.)
    calibration = summary["calibration"]
    for r in range(2):
        if calibration["realised_before"][r] > targets[r]:
            assert calibration["prices"][r] > 0, calibration
    for value, target in zip(calibration["realised_after"], targets):
        assert target - 0.02 <= value <= target + 1e-9, calibration
    # The deployed policy on other training batches: within the protocol's tolerance, spending up to
    # the target (an active target is met with equality, so not far under it either).
    other = _realised_on_other_training_batches(run, tiny_data)
    print("seed", seed, "calibrated", calibration["realised_after"], "other training batches", other,
          "held-out", (summary["valid/realised_flops"], summary["valid/realised_mem"]))
    for value, target in zip(other, targets):
        assert target - 2 * TOLERANCE <= value <= target + TOLERANCE, (other, targets)
    # The held-out split: another sample of documents (HELD_OUT_SHIFT).
    for value, target in zip((summary["valid/realised_flops"], summary["valid/realised_mem"]), targets):
        assert abs(value - target) <= HELD_OUT_SHIFT, summary


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_training_policy_swing_at_the_end_is_reported(seed_runs, seed):
    summary, _, _ = seed_runs[seed]
    print("realised_tail", seed, summary["realised_tail"])
    tail = summary["realised_tail"]
    assert tail["steps"] == round(0.2 * STEPS)
    targets = (summary["target_flops"], summary["target_mem"])
    for r in range(2):
        assert tail["min"][r] <= tail["mean"][r] <= tail["max"][r]
        assert tail["std"][r] > 0  # the training policy still swings: why the deployed one is calibrated
        assert abs(tail["mean"][r] - targets[r]) <= 0.06, tail


def test_an_inactive_budget_decays_its_multipliers_and_never_raises_spending(seed_runs):
    summary, first, _ = seed_runs[3]
    assert first["lambdas"][0] > 0  # started priced (lambda_init = 0.3) ...
    assert summary["lambdas"] == [0.0, 0.0], summary  # ... and the multipliers decayed to zero
    assert summary["calibration"]["prices"] == [0.0, 0.0]
    assert summary["valid/realised_flops"] <= 1.0 and summary["valid/realised_mem"] <= 1.0
    assert summary["calibration"]["realised_after"] == summary["calibration"]["realised_before"]
