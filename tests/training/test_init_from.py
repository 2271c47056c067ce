"""`train.init_from`: a new run starts from another checkpoint's weights at any layout, with a
fresh optimizer, schedule and data position; an imported Hugging Face export is such a checkpoint."""

import json
from pathlib import Path

import pytest

from megatron_triroute.checkpoint import CheckpointError
from megatron_triroute.config import ConfigError

from .conftest import log_text, run_to_end, steps

pytestmark = pytest.mark.distributed

# Tensor-parallel 2 splits the KV heads. Without the budget the deployed policy is the plain argmax
# of the weights and running statistics, so a run that starts from them and trains no step
# evaluates exactly what the source evaluated at its end (no prices calibrated on other batches).
COMMON = ["triroute.model.n_kv_heads=2", "triroute.budget.enabled=false"]


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _held_out(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k.startswith("valid/")}


@pytest.fixture(scope="module")
def source(tiny_data, tmp_path_factory):
    """A 3-step one-process run (its step-3 checkpoint and summary)."""
    run = tmp_path_factory.mktemp("init_source") / "run"
    assert run_to_end(run, tiny_data, extra=[*COMMON, "train.steps=3"]) == 0, log_text(run)[-3000:]
    return run


@pytest.fixture(scope="module")
def imported(source, tmp_path_factory):
    """The source run exported to Hugging Face format and imported back (weights only)."""
    from megatron_triroute.export.exporter import export
    from megatron_triroute.export.importer import import_hf

    root = tmp_path_factory.mktemp("init_imported")
    return import_hf(export(source / "checkpoints", root / "hf"), root / "ckpt")


def _start(run: Path, data: Path, init_from: Path, nproc: int, extra: list[str]) -> None:
    assert run_to_end(run, data, nproc=nproc, extra=[f"train.init_from={init_from}", *extra]) == 0, \
        log_text(run)[-3000:]
    text = log_text(run)
    assert "initialised from" in text and "resumed from" not in text


@pytest.mark.parametrize("what, nproc, layout", [
    ("run", 1, []),
    ("step_dir", 2, ["parallel.tensor=2"]),
    ("imported", 2, ["parallel.expert=2"]),
])
def test_held_out_numbers_are_the_source_models(source, imported, tiny_data, tmp_path, what, nproc, layout):
    """With no step to train, the new run evaluates exactly the model it started from: the same
    held-out and tail perplexities and realised fractions as the source run's end, at another
    layout and through an export and import."""
    init_from = {"run": source / "checkpoints", "step_dir": source / "checkpoints" / "step_00000003",
                 "imported": imported}[what]
    run = tmp_path / "run"
    _start(run, tiny_data, init_from, nproc, [*COMMON, "train.steps=0", *layout])
    got, want = _held_out(_summary(run)), _held_out(_summary(source))
    assert sorted(got) == sorted(want) and len(want) >= 3
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").glob("step_*"))


def test_training_continues_from_the_weights_with_a_fresh_optimizer(source, imported, tiny_data, tmp_path):
    """Steps count from 0 with a fresh optimizer and data position; the first step's loss is not
    a fresh initialisation's (the exact weights are the held-out test's); the run checkpoints as
    its own."""
    from megatron_triroute.checkpoint.store import load_checkpoint

    run = tmp_path / "run"
    _start(run, tiny_data, imported, 1, [*COMMON, "train.steps=2"])
    got = steps(run)
    assert sorted(got) == [0, 1]
    assert abs(got[0]["loss"] - steps(source)[0]["loss"]) > 1e-3
    step, _, meta = load_checkpoint(run / "checkpoints")
    assert step == 2 and meta["adam_step"] == 2 and meta["consumed_samples"] == 2 * 4
    assert not meta.get("weights_only")


def test_an_imported_checkpoint_is_not_resumed(imported):
    from megatron_triroute.training.run_state import load_run

    with pytest.raises(CheckpointError, match="weights only.*train.init_from="):
        load_run(str(imported), None, None, None, None)


def test_another_model_shape_is_refused_naming_the_field(source):
    from megatron_triroute.checkpoint.store import load_checkpoint
    from megatron_triroute.training.run_state import init_from_checkpoint

    _, _, meta = load_checkpoint(source / "checkpoints")
    config = json.loads(json.dumps(meta["config"]))
    config["triroute"]["model"]["d_model"] = 2 * config["triroute"]["model"]["d_model"]
    with pytest.raises(ConfigError, match="(?s)triroute.model.d_model: checkpoint 64, this run 128.*Fix"):
        init_from_checkpoint(str(source / "checkpoints"), None, None, config)


def test_a_missing_or_hf_directory_is_refused_with_the_fix(tmp_path):
    from megatron_triroute.training.run_state import init_from_checkpoint

    with pytest.raises(CheckpointError, match="no checkpoint there"):
        init_from_checkpoint(str(tmp_path), None, None, {})
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="--import"):
        init_from_checkpoint(str(tmp_path), None, None, {})
