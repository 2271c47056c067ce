"""Real trainer runs saved at one parallel layout and resumed at another continue the
uninterrupted run: the same losses and budget multipliers step for step (within 1e-5), and the
same held-out perplexity at the end."""

import json
import shutil

import pytest

from .conftest import log_text, run_to_end, steps

pytestmark = pytest.mark.distributed

STEPS = 6
COMMON = [f"train.steps={STEPS}", "train.save_interval_steps=3", "triroute.model.n_kv_heads=2"]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("layout_reference") / "run"
    assert run_to_end(run, tiny_data, extra=COMMON) == 0, log_text(run)[-3000:]
    return run


def _close(got: dict, ref: dict, steps_range) -> None:
    for s in steps_range:
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], abs=1e-5), s
        assert got[s]["lambdas"] == pytest.approx(ref[s]["lambdas"], abs=1e-5), s


@pytest.mark.parametrize("first, first_ranks, then, then_ranks", [
    (["parallel.tensor=2"], 2, [], 1),                                         # TP2 -> TP1
    ([], 1, ["parallel.tensor=2"], 2),                                         # TP1 -> TP2
    (["parallel.pipeline=2"], 2, [], 1),                                       # PP2 -> PP1
    (["parallel.expert=2"], 2, [], 1),                                         # EP2 (x DP2) -> EP1
    # EP4 needs 4 data-parallel ranks: a global batch of 8 keeps micro-batches of 2 on both sides,
    # and 4 evaluation batches are the same held-out set at 2 and 4 ranks
    (["parallel.expert=2", "train.global_batch_size=8", "train.eval_batches=4"], 2,
     ["parallel.expert=4", "train.global_batch_size=8", "train.eval_batches=4"], 4),
    (["parallel.tensor=2", "parallel.expert=2"], 4, [], 1),                    # TP2 x EP2 (x DP2) -> TP1 x EP1
], ids=["tp2-tp1", "tp1-tp2", "pp2-pp1", "ep2-ep1", "ep2-ep4", "tp2ep2-tp1ep1"])
def test_resume_at_another_layout_continues_the_uninterrupted_run(reference, tiny_data, tmp_path, first, first_ranks,
                                                                  then, then_ranks):
    run = tmp_path / "run"
    assert run_to_end(run, tiny_data, nproc=first_ranks, extra=COMMON + first) == 0, log_text(run)[-3000:]
    uninterrupted = steps(run)  # the first layout's own run, to the end
    finished = json.loads((run / "summary.json").read_text())
    # Forget the last checkpoint so the resume starts from step 3, written at the first layout.
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    (run / "summary.json").unlink()
    assert run_to_end(run, tiny_data, nproc=then_ranks, extra=COMMON + then) == 0, log_text(run)[-3000:]
    text = log_text(run)
    assert "resumed from step 3" in text and "written at tensor/pipeline/expert/data-parallel" in text
    got = steps(run)
    _close(got, uninterrupted, range(3, STEPS))  # the resumed steps continue the run that wrote the checkpoint
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["valid/ppl"] == pytest.approx(finished["valid/ppl"], rel=1e-5)
    if not any(o.startswith(("parallel.pipeline", "train.global_batch_size")) for o in first):
        # ... which is the one-process run too. (Under pipeline parallelism each stage initialises its
        # layers from the seed on its own, so that run starts from other weights than one process.)
        _close(got, steps(reference), range(STEPS))


def test_dense_resumes_from_tensor_parallel_two_on_one_process(tiny_data, tmp_path):
    """Dense's SwiGLU fc1 weight is described by a factory (its gate and up halves sharded
    separately), and its AdamW moments must follow it: TP2 -> TP1 continues the uninterrupted run."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert run_to_end(reference, tiny_data, recipe="tiny-dense", extra=COMMON) == 0, log_text(reference)[-3000:]
    assert run_to_end(run, tiny_data, nproc=2, recipe="tiny-dense", extra=COMMON + ["parallel.tensor=2"]) == 0, \
        log_text(run)[-3000:]
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    (run / "summary.json").unlink()
    assert run_to_end(run, tiny_data, nproc=1, recipe="tiny-dense", extra=COMMON) == 0, log_text(run)[-3000:]
    assert "resumed from step 3" in log_text(run)
    _close(steps(run), steps(reference), range(STEPS))
