"""Real trainer runs saved at one parallel layout and resumed at another continue the
uninterrupted run: the same losses and budget multipliers step for step, the same updated
parameters at the end (within 1e-5), the same AdamW moments (within 5e-4 of each tensor's largest
magnitude: at eps 1e-3 a second moment restored wrong barely moves the parameters, so the moments
are compared themselves), and the same held-out perplexity.

The first layout runs to its step-3 checkpoint and stops there (`train.exit_interval=3`); the
resumed run takes the rest of the same schedule at the second layout."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_triroute.checkpoint.sharded import full_model_state
from megatron_triroute.training.config import OptimConfig

from .conftest import assert_moments_close, log_text, moments, run_to_end, steps

pytestmark = pytest.mark.distributed

STEPS = 6
# AdamW's eps is raised from 1e-8 to 1e-3. With eps 1e-8 an element whose gradient is at rounding
# noise moves by about +-lr whatever the noise's sign, so two layouts that sum in another order (TP2
# vs TP1) end up to ~1e-4 apart on a few elements while every loss agrees to 1e-5. At 1e-3 such an
# element moves by lr * m / eps, which is continuous in the gradient; the second moment still sets
# the step of the elements whose gradients are larger (sqrt(v) above eps on 15-80 % of most weights).
# The pairs compared with their own first layout's run (PP2 -> PP1, EP2 -> EP4) keep the default
# eps: they pass at it (parameters within 1e-5, moments within 3.4e-7 and bit-identical).
COMMON = [f"train.steps={STEPS}", "train.save_interval_steps=3", "triroute.model.n_kv_heads=2", "optim.eps=1e-3"]
# Small buckets, so every rank's shard of the distributed optimizer cuts through parameters: its
# whole-moment checkpoint is gathered from, and sliced back into, shards that split tensors.
SMALL_BUCKETS = ["parallel.bucket_mb=0.01"]
DEFAULT_EPS = f"optim.eps={OptimConfig().eps}"
MOMENT_TOL = 1e-2  # measured up to 5.6e-3 (TP2 -> TP1, exp_avg of the attention output projection; 1.3e-4 before the
# per-mode attention kernels and the one-hash noise, with the parameters still within 1e-5). TP2 sums the attention
# heads and the controller's gradient in another order, and the moments integrate those gradients; a moment that
# was not carried over is off by about 1.
HALF = ["train.exit_interval=3"]  # checkpoint at step 3 and stop: the first layout's half of the run


def _run(run: Path, data: Path, nproc: int, extra: list[str], recipe: str = "tiny") -> None:
    assert run_to_end(run, data, nproc=nproc, recipe=recipe, extra=COMMON + extra) == 0, log_text(run)[-3000:]


def _final_state(run: Path) -> dict[str, torch.Tensor]:
    return full_model_state(run / "checkpoints" / f"step_{STEPS:08d}" / "sharded")


def _first_half(run: Path, data: Path, nproc: int, extra: list[str], recipe: str = "tiny") -> None:
    _run(run, data, nproc, extra + HALF, recipe)
    assert sorted(steps(run)) == [0, 1, 2], "train.exit_interval=3 must stop after the step-3 checkpoint"
    assert not (run / "summary.json").exists()


def _resume(run: Path, data: Path, nproc: int, extra: list[str], recipe: str = "tiny") -> None:
    _run(run, data, nproc, extra, recipe)
    text = log_text(run)
    assert "resumed from step 3" in text and "written at tensor/pipeline/expert/data-parallel" in text


def _assert_engine(run: Path) -> None:
    assert "distributed optimizer: this rank updates" in log_text(run), "the run did not use the default engine"


def _assert_continues(run: Path, uninterrupted: Path) -> None:
    """`run` (resumed at step 3) matches `uninterrupted`: every resumed step's loss and multipliers,
    the parameters and buffers of the step-6 checkpoint, and the final held-out perplexity."""
    got, ref = steps(run), steps(uninterrupted)
    for s in range(3, STEPS):
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], abs=1e-5), s
        assert got[s]["lambdas"] == pytest.approx(ref[s]["lambdas"], abs=1e-5), s
    want = _final_state(uninterrupted)
    have = _final_state(run)
    assert sorted(have) == sorted(want)
    for name, tensor in want.items():
        assert have[name].shape == tensor.shape, name
        # the end-of-run prices are a bisection's output: its own test bounds them; everything else
        # (every parameter, the running statistics, the dual variables) must be the same
        if name != "budget.prices":
            torch.testing.assert_close(have[name], tensor, atol=1e-5, rtol=0, msg=name)
    # AdamW's moments, gathered whole from whichever optimizer's shards wrote them
    worst = assert_moments_close(moments(run, STEPS), moments(uninterrupted, STEPS), MOMENT_TOL)
    print(f"moments: worst error {worst:.3g} of a tensor's largest magnitude")
    resumed = json.loads((run / "summary.json").read_text())
    finished = json.loads((uninterrupted / "summary.json").read_text())
    assert resumed["valid/ppl"] == pytest.approx(finished["valid/ppl"], rel=1e-5)


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """The uninterrupted one-process run (its step-3 checkpoint is kept: keep_last is 3)."""
    run = tmp_path_factory.mktemp("layout_reference") / "run"
    _run(run, tiny_data, 1, [])
    return run


@pytest.mark.parametrize("then, then_ranks", [
    (["parallel.tensor=2"], 2),                                                 # TP1 -> TP2
    (["parallel.expert=2"], 2),                                                 # EP1 -> EP2 (x DP2)
    (["parallel.tensor=2"] + SMALL_BUCKETS, 4),                                 # TP1 -> TP2 x DP2
], ids=["tp1-tp2", "ep1-ep2", "tp1-tp2dp2"])
def test_resume_from_one_process_at_another_layout(reference, tiny_data, tmp_path, then, then_ranks):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "step_00000003", run / "checkpoints" / "step_00000003")
    _resume(run, tiny_data, then_ranks, then)
    _assert_engine(run)
    _assert_continues(run, reference)


@pytest.mark.parametrize("first, first_ranks", [
    (["parallel.tensor=2"], 2),                                                 # TP2 -> TP1
    (["parallel.expert=2"], 2),                                                 # EP2 (x DP2) -> EP1
    (["parallel.tensor=2", "parallel.expert=2"] + SMALL_BUCKETS, 4),            # TP2 x EP2 (x DP2) -> TP1 x EP1
], ids=["tp2-tp1", "ep2-ep1", "tp2ep2-tp1ep1"])
def test_resume_on_one_process_from_another_layout(reference, tiny_data, tmp_path, first, first_ranks):
    run = tmp_path / "run"
    _first_half(run, tiny_data, first_ranks, first)
    _assert_engine(run)
    _resume(run, tiny_data, 1, [])
    _assert_continues(run, reference)


@pytest.mark.parametrize("first, first_ranks, then, then_ranks", [
    # Under pipeline parallelism each stage initialises its own layers from the seed, so a PP2 run
    # starts from other weights than one process: it is compared with the PP2 run it continues.
    # At AdamW's default eps (after COMMON's 1e-3: the last override wins).
    (["parallel.pipeline=2", DEFAULT_EPS], 2, [DEFAULT_EPS], 1),               # PP2 -> PP1
    # EP4 needs 4 data-parallel ranks: a global batch of 8 keeps micro-batches of 2 on both sides,
    # and 4 evaluation batches are the same held-out set at 2 and 4 ranks
    (["parallel.expert=2", "train.global_batch_size=8", "train.eval_batches=4", DEFAULT_EPS], 2,
     ["parallel.expert=4", "train.global_batch_size=8", "train.eval_batches=4", DEFAULT_EPS], 4),
], ids=["pp2-pp1", "ep2-ep4"])
def test_resume_continues_the_first_layouts_own_run(tiny_data, tmp_path, first, first_ranks, then, then_ranks):
    run, uninterrupted = tmp_path / "run", tmp_path / "uninterrupted"
    _run(run, tiny_data, first_ranks, first)
    # Set the uninterrupted end aside; the resume then starts from step 3, written at the first layout.
    uninterrupted.mkdir()
    shutil.move(run / "summary.json", uninterrupted / "summary.json")
    shutil.copy(run / "steps.jsonl", uninterrupted / "steps.jsonl")
    (uninterrupted / "checkpoints").mkdir()
    shutil.move(run / "checkpoints" / "step_00000006", uninterrupted / "checkpoints" / "step_00000006")
    _resume(run, tiny_data, then_ranks, then)
    _assert_continues(run, uninterrupted)


def test_dense_resumes_from_tensor_parallel_two_on_one_process(tiny_data, tmp_path):
    """Dense's SwiGLU fc1 weight is described by a factory (its gate and up halves sharded
    separately), and its AdamW moments must follow it: TP2 -> TP1 continues the uninterrupted run."""
    reference, run = tmp_path / "dense_reference", tmp_path / "dense_run"
    _run(reference, tiny_data, 1, [], recipe="tiny-dense")
    _first_half(run, tiny_data, 2, ["parallel.tensor=2"], recipe="tiny-dense")
    _resume(run, tiny_data, 1, [], recipe="tiny-dense")
    _assert_continues(run, reference)
