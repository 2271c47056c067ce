"""One real (six-step) tiny training run shared by the evaluation tests: its checkpoint, its
`summary.json` (the trainer's own held-out evaluation) and its data directory (the tokenizer). It
also saves at step 3, a mid-run checkpoint whose prices were never calibrated."""

import pytest

from tests.training.conftest import TINY_OVERRIDES, run_to_end


@pytest.fixture(scope="session")
def trained_run(tiny_data, tmp_path_factory):  # noqa: F811
    run_dir = tmp_path_factory.mktemp("evaluation") / "run"
    rc = run_to_end(run_dir, tiny_data, overrides=TINY_OVERRIDES + ["train.steps=6", "train.save_interval_steps=3"])
    assert rc == 0, (run_dir.parent / "run.log").read_text()[-3000:]
    return run_dir
