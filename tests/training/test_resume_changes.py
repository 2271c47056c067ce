"""Real trainer runs resumed with a changed config: a new budget target takes effect (also from a
checkpoint that still holds the old target), a forbidden change is refused before anything is
written."""

import json
import shutil

import pytest
import torch

from megatron_triroute.checkpoint import load_shards, save_checkpoint

from .conftest import log_text, run_to_end, steps

FIRST, TOTAL = 4, 6
BASE = ["train.save_interval_steps=100", "triroute.budget.dual_kp=0", "triroute.budget.flops_target=0.5"]


@pytest.fixture(scope="module")
def first_run(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("changes") / "first"
    assert run_to_end(run, tiny_data, extra=BASE + [f"train.steps={FIRST}"]) == 0, log_text(run)[-3000:]
    return run


def as_written_before_targets_were_config_only(run):
    """Re-save the final checkpoint with the budget targets in the model state, as older code did.
    Layout-independent checkpoints keep the model under `sharded/` and never hold the targets
    (checked here); the per-rank format that did is resumed with its targets in
    tests/training/test_resume_legacy.py."""
    from megatron_triroute.checkpoint.sharded import read_metadata
    from megatron_triroute.checkpoint.store import EXTRA_DIR

    root = run / "checkpoints"
    step, shards, meta = load_shards(root)
    if "model" not in shards[0]:
        keys = read_metadata(root / f"step_{step:08d}" / EXTRA_DIR).state_dict_metadata
        assert "model.budget.lambdas" in keys and not any(k.endswith("budget.targets") for k in keys)
        return step
    shards[0]["model"]["budget.targets"] = torch.tensor([0.5, 0.4], dtype=torch.float64)
    save_checkpoint(root, step, shards[0], meta)
    return step


def test_a_new_flops_target_takes_effect_on_resume(first_run, tiny_data, tmp_path):
    run = tmp_path / "resumed"
    shutil.copytree(first_run, run)
    assert as_written_before_targets_were_config_only(run) == FIRST
    extra = BASE + [f"train.steps={TOTAL}", "triroute.budget.flops_target=0.7"]
    assert run_to_end(run, tiny_data, extra=extra) == 0, log_text(run)[-3000:]
    text = log_text(run)
    assert f"resumed from step {FIRST}" in text
    assert "resume changes triroute.budget.flops_target: 0.5 -> 0.7 (budget target)" in text
    assert f"resume changes train.steps: {FIRST} -> {TOTAL} (schedule length)" in text
    assert f"resume changes output_dir: '{first_run}' -> '{run}' (output path)" in text
    assert json.loads((run / "summary.json").read_text())["target_flops"] == 0.7
    assert json.loads((run / "config.json").read_text())["triroute"]["budget"]["flops_target"] == 0.7

    # The dual update, recomputed by hand from the logged realised fractions (dual_kp=0, so the
    # logged multipliers are the integral ones): old target before the resume, new one after.
    record = steps(run)
    assert sorted(record) == list(range(TOTAL)) and not any(r["skipped"] for r in record.values())
    m, rho, mem_target = 0.9, 0.05, 0.4  # BudgetConfig defaults: ema_momentum, dual_step, mem_target
    ema, lam = None, [0.0, 0.0]
    for s in range(TOTAL):
        realised = record[s]["realised"]
        ema = list(realised) if ema is None else [m * e + (1 - m) * r for e, r in zip(ema, realised)]
        targets = [0.5 if s < FIRST else 0.7, mem_target]
        stale = [max(0.0, lam[0] + rho * (ema[0] - 0.5))]
        lam = [max(0.0, x + rho * (e - t)) for x, e, t in zip(lam, ema, targets)]
        assert record[s]["lambdas"] == pytest.approx(lam, rel=1e-9, abs=1e-12), s
        if s >= FIRST:  # the old target would have given another multiplier
            assert record[s]["lambdas"][0] != pytest.approx(stale[0], rel=1e-9, abs=1e-12), s


def test_a_forbidden_change_is_refused_and_config_json_kept(first_run, tiny_data, tmp_path):
    run = tmp_path / "refused"
    shutil.copytree(first_run, run)
    saved_config = (run / "config.json").read_text()
    extra = BASE + [f"train.steps={TOTAL}", "triroute.model.d_model=32", "triroute.seed=7"]
    assert run_to_end(run, tiny_data, extra=extra) == 2, log_text(run)[-3000:]
    text = log_text(run)
    assert "2 field(s) differ that a resume may not change" in text
    assert "triroute.model.d_model: checkpoint 64, this run 32 (model shape)" in text
    assert "triroute.seed: checkpoint 1234, this run 7 (seed)" in text
    assert "Fix: resume with the checkpoint's values (triroute.model.d_model=64 triroute.seed=1234)" in text
    assert (run / "config.json").read_text() == saved_config
    assert "resumed from step" not in text
