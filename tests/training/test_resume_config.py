"""What a resume may change: allowed changes are listed one line per field, forbidden ones refused
with every field, both values and the fix; the budget targets come from the config, not the
checkpoint."""

import pytest
import torch

from megatron_triroute.config import BudgetConfig, ConfigError
from megatron_triroute.routing.budget import BudgetController
from megatron_triroute.training.config import RunConfig, apply_overrides
from megatron_triroute.training.resume_config import MAY_CHANGE, check_resume_config
from megatron_triroute.training.run_state import STALE_KEYS


def config(*overrides: str) -> dict:
    return apply_overrides(RunConfig(), list(overrides)).to_dict()


def test_unchanged_config_reports_nothing():
    assert check_resume_config(config(), config(), source="ckpt") == []


def test_allowed_changes_are_one_line_each():
    lines = check_resume_config(
        config("train.steps=100", "triroute.budget.flops_target=0.5"),
        config("train.steps=200", "triroute.budget.flops_target=0.7", "output_dir=/elsewhere", "parallel.expert=2",
               "data.buckets=code,math"),
        source="ckpt")
    assert lines == [
        "data.buckets: ['rare_entity', 'code', 'math', 'long_context'] -> ['code', 'math'] (evaluation sets)",
        "output_dir: 'runs/tiny' -> '/elsewhere' (output path)",
        "parallel.expert: 1 -> 2 (parallel layout)",
        "train.steps: 100 -> 200 (schedule length)",
        "triroute.budget.flops_target: 0.5 -> 0.7 (budget target)",
    ]


def test_a_checkpoint_of_a_retired_engine_resumes_on_the_default_engine():
    """A checkpoint whose config names a retired engine (which a new run may no longer name)
    resumes on megatron_distopt, each change one line."""
    saved = config()
    saved["parallel"].update(dp_engine="replicated", overlap_param_gather=False)
    assert check_resume_config(saved, config(), source="ckpt") == [
        "parallel.dp_engine: 'replicated' -> 'megatron_distopt' (how gradients are reduced (the same update; "
        "the optimizer state is the same))",
        "parallel.overlap_param_gather: False -> True (when updated parameters are gathered (same math))",
    ]


def test_forbidden_changes_are_refused_naming_each_field_both_values_and_the_fix():
    saved = config("triroute.model.d_model=64", "triroute.router.bits=2,4,16", "triroute.seed=1")
    new = config("triroute.model.d_model=128", "triroute.router.bits=4,16", "triroute.seed=2", "train.steps=5",
                 "triroute.model.vocab_size=512")
    with pytest.raises(ConfigError) as error:
        check_resume_config(saved, new, source="/runs/x/checkpoints/step_00000004")
    message = str(error.value)
    assert "cannot resume from /runs/x/checkpoints/step_00000004: 4 field(s)" in message
    assert "triroute.model.d_model: checkpoint 64, this run 128 (model shape)" in message
    assert "triroute.router.bits: checkpoint [2, 4, 16], this run [4, 16] (KV bit widths)" in message
    assert "triroute.seed: checkpoint 1, this run 2 (seed)" in message
    assert "triroute.model.vocab_size: checkpoint 256, this run 512 (tokenizer vocabulary)" in message
    assert "train.steps" not in message.split("Fix:")[0]  # an allowed change is not listed as refused
    # The fix is a set of overrides that, applied to the new config, makes the resume pass.
    fix = message.split("resume with the checkpoint's values (")[1].split(")")[0]
    repaired = apply_overrides(RunConfig.from_dict(new), fix.split()).to_dict()
    assert check_resume_config(saved, repaired, source="ckpt") == ["train.steps: 1000 -> 5 (schedule length)"]


@pytest.mark.parametrize("field,value", [
    ("triroute.router.num_experts", 4), ("triroute.losses.z_weight", 0.5), ("optim.lr", 0.1),
    ("triroute.budget.dual_step", 0.5), ("train.global_batch_size", 16), ("data.seed", 7),
    ("system", "dense"), ("train.bf16", True),
])
def test_every_field_not_listed_as_changeable_is_refused(field, value):
    assert field not in MAY_CHANGE
    new = config()
    *sections, leaf = field.split(".")
    node = new
    for section in sections:
        node = node[section]
    assert leaf in node and node[leaf] != value
    node[leaf] = value
    with pytest.raises(ConfigError, match=f"{field}: checkpoint"):
        check_resume_config(config(), new, source="ckpt")


def test_budget_targets_come_from_the_config_not_the_checkpoint():
    old = BudgetController(BudgetConfig(flops_target=0.5, mem_target=0.4))
    old.update(torch.tensor([0.8, 0.6], dtype=torch.float64))
    saved = old.state_dict()
    assert "targets" not in saved
    saved["targets"] = torch.tensor([0.5, 0.4], dtype=torch.float64)  # as checkpoints written before held it
    new = BudgetController(BudgetConfig(flops_target=0.7, mem_target=0.3))
    new.load_state_dict({k: v for k, v in saved.items() if not f"budget.{k}".endswith(STALE_KEYS)})
    assert new.targets.tolist() == [0.7, 0.3]
    assert new.ema.tolist() == [0.8, 0.6] and new.steps.item() == 1  # the controller's state is restored
    lam = new.multipliers()
    # Penalty, by hand with the new targets: sum_r lambda_r (C_r - C*_r).
    fractions = torch.tensor([0.9, 0.2], dtype=torch.float64)
    expected = lam[0] * (0.9 - 0.7) + lam[1] * (0.2 - 0.3)
    assert new.penalty(fractions).item() == pytest.approx(expected.item(), rel=1e-12)
    # Dual update, by hand: EMA <- m EMA + (1-m) C; lambda <- [lambda + rho (EMA - C*)]_+.
    c = new.config
    before = new.lambdas.clone()
    new.update(torch.tensor([0.75, 0.5], dtype=torch.float64))
    ema = [c.ema_momentum * 0.8 + (1 - c.ema_momentum) * 0.75, c.ema_momentum * 0.6 + (1 - c.ema_momentum) * 0.5]
    want = [max(0.0, before[0].item() + c.dual_step * (ema[0] - 0.7)),
            max(0.0, before[1].item() + c.dual_step * (ema[1] - 0.3))]
    assert new.lambdas.tolist() == pytest.approx(want, rel=1e-12)
    assert want[0] != pytest.approx(max(0.0, before[0].item() + c.dual_step * (ema[0] - 0.5)))  # old target differs
