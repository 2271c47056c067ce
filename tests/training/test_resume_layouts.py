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


@pytest.mark.parametrize("first, then", [
    (["parallel.tensor=2"], []),            # TP2 -> TP1
    (["parallel.expert=2"], []),            # EP2 (x DP2) -> EP1
])
def test_resume_at_another_layout_continues_the_uninterrupted_run(reference, tiny_data, tmp_path, first, then):
    run = tmp_path / "run"
    assert run_to_end(run, tiny_data, nproc=2, extra=COMMON + first) == 0, log_text(run)[-3000:]
    # Forget the last checkpoint so the resume starts from step 3, written at the first layout.
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    (run / "summary.json").unlink()
    assert run_to_end(run, tiny_data, nproc=1, extra=COMMON + then) == 0, log_text(run)[-3000:]
    text = log_text(run)
    assert "resumed from step 3" in text and "written at tensor/pipeline/expert/data-parallel" in text
    ref, got = steps(reference), steps(run)
    _close(got, ref, range(STEPS))
    a = json.loads((reference / "summary.json").read_text())
    b = json.loads((run / "summary.json").read_text())
    assert b["valid/ppl"] == pytest.approx(a["valid/ppl"], rel=1e-5)
