import math

import pytest
import torch

from megatron_triroute.config import ConfigError
from megatron_triroute.training.config import RunConfig, apply_overrides
from megatron_triroute.training.dry_run import dry_run
from megatron_triroute.training.planner import estimate_rank_memory
from megatron_triroute.training.recipes import dense_parameter_count, get_recipe


def test_overrides_parse_by_field_type_and_round_trip():
    run = get_recipe("tiny")
    apply_overrides(run, ["train.steps=7", "optim.lr=1e-3", "triroute.router.null_expert=false",
                          "triroute.router.bits=4,16", "output_dir=/tmp/x", "train.bf16=true"])
    assert run.train.steps == 7 and run.optim.lr == 1e-3 and run.triroute.router.null_expert is False
    assert run.triroute.router.bits == (4, 16) and run.output_dir == "/tmp/x" and run.train.bf16 is True
    assert RunConfig.from_dict(run.to_dict()) == run


@pytest.mark.parametrize("item,needle", [
    ("train.stepz=3", "unknown field 'stepz'"),
    ("trian.steps=3", "no section 'trian'"),
    ("train.steps=three", "cannot parse"),
    ("train.steps", "expected key=value"),
])
def test_bad_overrides_name_the_problem(item, needle):
    with pytest.raises(ConfigError, match=needle):
        apply_overrides(get_recipe("tiny"), [item])


@pytest.mark.parametrize("raw, value", [("0", False), ("1", True), ("FALSE", False), ("yes", True), ("Off", False),
                                        ("none", None), ("NULL", None)])
def test_boolean_overrides_parse_strictly(raw, value):
    """`train.bf16=0` is off (the string "0" is truthy: it must never be stored as such)."""
    recompute = "on" if value is None else raw  # not optional: no none
    run = apply_overrides(get_recipe("tiny"), [f"train.bf16={raw}", f"train.recompute={recompute}"])
    assert run.train.bf16 is value and run.train.recompute is (True if value is None else value)


@pytest.mark.parametrize("item, needle", [
    ("train.bf16=maybe", r"train.bf16='maybe': not a boolean. Fix: use true or false \(or 1/0, yes/no, on/off, any "
                         r"case\), or none"),
    ("train.recompute=none", r"train.recompute='none': not a boolean. Fix: .*any case\)\.$"),
    ("train.steps=1.5", r"train.steps='1.5': cannot parse as int. Fix: give an integer"),
    ("optim.lr=abc", r"optim.lr='abc': cannot parse as float. Fix: give a number"),
    ("data.train_weights=0.5,x", r"data.train_weights='x': cannot parse as float"),
    ("triroute.router.estimator=adam", r"estimator='adam': not one of the field's choices. Fix: use one of st_gumbel, "
                                       r"reinforce"),
])
def test_overrides_of_the_wrong_type_are_refused_naming_field_value_and_spellings(item, needle):
    with pytest.raises(ConfigError, match=needle):
        apply_overrides(get_recipe("tiny"), [item])


def test_every_field_is_type_checked_after_the_overrides():
    from megatron_triroute.config import check_types

    run = apply_overrides(get_recipe("tiny"), ["data.train_weights=1,3"])
    assert run.data.train_weights == (1.0, 3.0) and all(type(w) is float for w in run.data.train_weights)
    check_types(run)  # a recipe with its overrides applied is well typed
    for section, name, value, kind in [("train", "steps", "3", "an integer"), ("optim", "lr", True, "a number"),
                                       ("train", "bf16", "0", "true or false, or none"),
                                       ("train", "recompute", 1, "true or false")]:
        run = get_recipe("tiny")
        setattr(getattr(run, section), name, value)
        with pytest.raises(ConfigError, match=rf"{section}.{name}={value!r}: is a \w+, the field takes {kind}\. "):
            check_types(run)


def test_an_unknown_recipe_names_the_known_ones_and_the_closest():
    with pytest.raises(ConfigError, match=r"unknown recipe 'tinyy'; known: tiny, 160m, 410m, 1p3b .* did you mean "
                                          r"--recipe tiny\?"):
        get_recipe("tinyy")
    with pytest.raises(ConfigError, match=r"unknown system 'moee' .* did you mean --recipe 160m-moe\?"):
        get_recipe("160m-moee")


def test_the_training_command_line_reports_bad_input_with_exit_status_2():
    import subprocess
    import sys

    from tests.conftest import REPO

    done = subprocess.run([sys.executable, "-m", "megatron_triroute.train", "--recipe", "tinyy"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("error: unknown recipe 'tinyy'") and "Traceback" not in done.stderr


def test_layout_validation_names_the_fix():
    run = get_recipe("160m")
    run.parallel.tensor = 2
    with pytest.raises(ConfigError, match=r"parallel.tensor=2: does not divide n_kv_heads=3. Fix: use parallel.tensor in \[1, 3\]"):
        run.validate(8)
    run = get_recipe("tiny")
    run.parallel.expert = 3
    with pytest.raises(ConfigError, match="parallel.expert=3"):
        run.validate(3)
    run = get_recipe("tiny")
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        run.validate(3)  # 8 sequences do not split over 3 data-parallel ranks of micro-batch 8


def test_dp_engine_validation_names_the_fix():
    """The default engine with its options validates; an unknown or retired engine, an unknown
    reduction dtype, a negative bucket size and bf16 gradients under an fp32 forward are refused,
    each naming the fix."""
    run = apply_overrides(get_recipe("tiny"), ["parallel.bucket_mb=2.5", "parallel.overlap_param_gather=false",
                                               "parallel.overlap_grad_reduce=false"])
    p = run.validate(1).parallel
    assert (p.dp_engine, p.overlap_param_gather, p.overlap_grad_reduce) == ("megatron_distopt", False, False)
    p = get_recipe("tiny").parallel  # the default: both collectives overlapped
    assert (p.dp_engine, p.overlap_grad_reduce, p.overlap_param_gather) == ("megatron_distopt", True, True)
    refused = {
        "parallel.dp_engine=fsdp": r"parallel.dp_engine='fsdp': is not a data-parallel engine. Fix: use one of megatron_distopt",
        "parallel.dp_engine=replicated": r"parallel.dp_engine='replicated': was retired: .* Fix: drop the override "
                                         r"\(megatron_distopt is the default; it resumes checkpoints written with replicated\)",
        "parallel.dp_engine=megatron": r"parallel.dp_engine='megatron': was retired: .* Fix: drop the override",
        "parallel.grad_reduce_dtype=fp16": r"parallel.grad_reduce_dtype='fp16': is not a reduction dtype. Fix: use fp32 or bf16",
        "parallel.bucket_mb=-1": r"parallel.bucket_mb=-1.0: must be >= 0",
    }
    for override, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            apply_overrides(get_recipe("tiny"), [override]).validate(1)
    bf16 = ["parallel.grad_reduce_dtype=bf16"]
    assert apply_overrides(get_recipe("tiny"), bf16 + ["train.bf16=true"]).validate(1)
    assert apply_overrides(get_recipe("tiny"), bf16).validate(1)  # unset: decided by the hardware at start
    with pytest.raises(ConfigError, match=r"parallel.grad_reduce_dtype='bf16': makes the matrices bf16 parameters "
                                          r".* Fix: set train.bf16=true"):
        apply_overrides(get_recipe("tiny"), bf16 + ["train.bf16=false"]).validate(1)


def test_bf16_gradients_refuse_an_fp32_forward_at_start(monkeypatch):
    """train.bf16 unset computes in fp32 without CUDA: the engine's builder refuses bf16 parameters
    then, with the same check as the config's, before building anything."""
    from megatron_triroute.training.trainer import build_optimizer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = apply_overrides(get_recipe("tiny"), ["parallel.grad_reduce_dtype=bf16"])
    assert run.validate(1).train.bf16 is None
    with pytest.raises(ConfigError, match=r"this run computes in fp32 .* Fix: set train.bf16=true"):
        build_optimizer(torch.nn.Linear(2, 2), run, groups=None)


def test_recipe_steps_follow_twenty_tokens_per_parameter():
    run = get_recipe("410m")
    m = run.triroute.model
    params = (2 * m.vocab_size * m.d_model
              + m.n_layers * (m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.d_head + m.n_heads * m.d_head * m.d_model
                              + 3 * m.d_model * m.d_ff + 2 * m.d_model) + m.d_model)
    assert dense_parameter_count(run.triroute) == params
    tokens_per_step = run.train.global_batch_size * m.seq_len
    assert run.train.steps == math.ceil(20 * params / tokens_per_step)


def test_system_suffix_selects_the_preset():
    assert get_recipe("tiny-moe").triroute.router.null_expert is False
    assert get_recipe("tiny-dense").triroute.budget.enabled is False
    with pytest.raises(ValueError, match="unknown system"):
        get_recipe("tiny-nonsense")


def test_dry_run_reports_layout_and_memory(capsys):
    run = get_recipe("1p3b")
    run.parallel.tensor, run.parallel.expert = 4, 8
    assert dry_run(run, 64) == 0
    out = capsys.readouterr().out
    assert "tensor 4 x pipeline 1 x data 16" in out and "dry run OK" in out
    more_experts = estimate_rank_memory(run, 64)["parameters_per_rank"]
    run.parallel.expert = 1
    assert estimate_rank_memory(run, 64)["parameters_per_rank"] > more_experts  # experts spread over ranks


def test_training_flops_per_token_hand_count():
    from megatron_triroute.training.metrics import training_flops_per_token

    run = get_recipe("tiny")
    m = run.triroute.model  # d 128, L 4, H 4, H_kv 1, d_h 32, d_ff 384, T 128, V 4096
    budgeted = 2 * 128 * (129 / 2) + 3 * 128 * 384
    projections = (4 + 2) * 32 * 128 + 4 * 32 * 128
    expected = 6 * (4 * (0.5 * budgeted + projections) + 4096 * 128)
    assert (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.seq_len, m.vocab_size) == (128, 4, 4, 1, 384, 128, 4096)
    assert training_flops_per_token(run.triroute, 0.5) == expected


def test_a_system_override_reconfigures_like_the_recipe_suffix():
    from megatron_triroute.config import ConfigError
    from megatron_triroute.training.recipes import resolve

    by_override = resolve("tiny", ["system=moe", "train.steps=7"])
    by_name = resolve("tiny-moe", ["train.steps=7"])
    assert by_override.to_dict() == by_name.to_dict()  # the routing tree changed, not only the label
    assert by_override.system == "moe" and by_override.triroute.router.null_expert is False
    with pytest.raises(ConfigError, match="names system 'mod'"):
        resolve("tiny-mod", ["system=moe"])
    with pytest.raises(ConfigError, match="applied with the recipe"):
        apply_overrides(get_recipe("tiny"), ["system=moe"])
