"""The trainer aborts with a clear message after `train.max_nonfinite_steps` skipped steps in a row."""

import subprocess
import sys

from .conftest import REPO, TINY_OVERRIDES

# Runs the real entry point with every step reported as non-finite (what a diverged run looks like).
WRAPPER = """
import sys
import megatron_triroute.training.engine as engine
from megatron_triroute.training.engine import StepReport
engine.TrainEngine.train_step = lambda self, mbs, step: StepReport(step, float("nan"), True, float("nan"), 1.0)
from megatron_triroute.train import cli
sys.exit(cli(sys.argv[1:]))
"""


def test_too_many_nonfinite_steps_abort_the_run(tiny_data, tmp_path):
    args = ["--recipe", "tiny", f"data.path={tiny_data}", f"output_dir={tmp_path / 'run'}", *TINY_OVERRIDES,
            "train.steps=20", "train.max_nonfinite_steps=3"]
    done = subprocess.run([sys.executable, "-c", WRAPPER, *args], cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": "29817", "PYTHONPATH": str(REPO)})
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "3 consecutive non-finite steps" in out
    assert out.count("non-finite loss or gradient; step skipped") == 3
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").glob("step_*"))
