"""benchmarks/gpu_checks.sh's stage selection (STAGES), run with a stand-in for Python that records
each command it is given instead of running it (no GPU is needed to see what would run)."""

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_checks.sh"
EVERY_STAGE = ["gpu-tests", "bench-decode-cuda", "bench-train-step-mb4", "bench-train-step-mb16",
               "bench-train-step-deepspeed-experts", "bench-train-step-blocks-local", "bench-paged-attention",
               "bench-paged-attention-variants", "train-160m", "train-160m-dense"]


def run_checks(tmp_path: Path, stages: str | None, exit_code: int = 0) -> tuple[subprocess.CompletedProcess, list[str]]:
    """The script run with STAGES (None: unset) and a stand-in for Python that records its arguments and
    exits with `exit_code`; the result and the recorded commands."""
    calls = tmp_path / "calls.log"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\nexit {exit_code}\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "STAGES"}
    env |= {"TRIROUTE_PYTHON": str(fake), "GPU_RUNS": str(tmp_path / "runs"), "PATH": f"{tmp_path}:{env['PATH']}"}
    if stages is not None:
        env["STAGES"] = stages
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=120)
    return done, calls.read_text().splitlines() if calls.exists() else []


def ran(stdout: str) -> list[str]:
    """The stages the log says started, in order."""
    return re.findall(r"^=== (\S+) \(\d\d:\d\d:\d\d, limit \d+s\)$", stdout, re.M)


def test_every_stage_runs_by_default_in_order(tmp_path):
    done, calls = run_checks(tmp_path, None)
    assert ran(done.stdout) == EVERY_STAGE
    assert any("bench_decode.py --device cuda" in c for c in calls)


def test_stages_selects_by_name_or_prefix_and_skips_the_rest(tmp_path):
    done, calls = run_checks(tmp_path, "bench-decode-cuda bench-train-step-mb")
    assert ran(done.stdout) == ["bench-decode-cuda", "bench-train-step-mb4", "bench-train-step-mb16"]
    assert "=== gpu-tests: not in STAGES" in done.stdout
    stage_calls = [c for c in calls if not c.startswith("-c ")]  # the version line's import check aside
    assert len(stage_calls) == 3
    assert "benchmarks/bench_decode.py --device cuda" in stage_calls[0]
    assert all("bench_train_step.py" in c for c in stage_calls[1:])
    assert done.returncode == 0, done.stdout[-2000:]


def test_a_failing_selected_stage_counts_in_the_exit_status(tmp_path):
    done, _ = run_checks(tmp_path, "bench-decode-cuda")
    assert done.returncode == 0
    failed, _ = run_checks(tmp_path, "bench-decode-cuda", exit_code=3)  # every command the stand-in runs fails
    assert failed.returncode == 1
    assert "stages failed: 1 bench-decode-cuda" in failed.stdout
