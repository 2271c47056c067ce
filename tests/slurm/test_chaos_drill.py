"""benchmarks/chaos_drill.py on the one-node cluster with one fault of each kind -- a USR1
pre-emption (checkpoint, exit 75, requeue), a SIGKILLed rank, a SIGKILL while a checkpoint is being
written, a corrupted newest checkpoint -- ending against the session's uninterrupted reference run:
every fault survived, no committed checkpoint lost, the same final parameters and losses."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_training_jobs import SAVE_EVERY, STEPS, TINY_ARGS

DRILL = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos_drill.py"
KINDS = ("sigusr1", "kill_rank", "kill_in_save", "corrupt")
SEED = 1


@pytest.mark.slurm
@pytest.mark.timeout(400)  # includes the reference run when run alone
def test_one_fault_of_each_kind_is_survived(slurm_cluster, tiny_data, reference_run, tmp_path):
    assert reference_run["state"] == "COMPLETED"
    done = subprocess.run(
        [sys.executable, str(DRILL), "--kinds", *KINDS, "--seed", str(SEED), "--steps", str(STEPS),
         "--save-every", str(SAVE_EVERY), "--train-args", TINY_ARGS, "--data", str(tiny_data),
         "--reference", str(reference_run["run_dir"]), "--reference-seconds", str(reference_run["seconds"]),
         "--work", str(tmp_path), "--timeout", "300", "--json"],
        env=slurm_cluster.env, capture_output=True, text=True, timeout=360,
    )
    assert done.stdout, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert done.returncode == 0, f"{report['missed']}\n{done.stderr[-4000:]}"
    assert report["faults_injected"] == report["faults_survived"] == {kind: 1 for kind in KINDS}, done.stderr
    assert report["checkpoints_lost"] == 0 and report["completed"]
    assert report["max_param_diff"] <= 1e-6
    assert report["max_loss_diff"] == 0.0  # the same layout resumes bit for bit
    faults = {f["kind"]: f for f in report["faults"]}
    # The kill landed inside the save: that save never committed, the resume is from the one before.
    assert faults["kill_in_save"]["resumed"] < faults["kill_in_save"]["at_step"]
    # The corrupted checkpoint was skipped for the one before it.
    assert faults["corrupt"]["resumed"] == faults["corrupt"]["detail"]["fallback"] < faults["corrupt"]["at_step"]
    # USR1 was handled by the job itself (checkpoint, exit 75, requeue): only the two kills needed a
    # resubmission, and the stop checkpoint held every step trained before the signal.
    assert len(report["jobs"]) == 3 and report["attempts"] == 4
    assert slurm_cluster.job_fields(faults["sigusr1"]["detail"]["job"])["Restarts"] == "1"
    assert faults["sigusr1"]["resumed"] == faults["sigusr1"]["detail"]["stop_checkpoint"] >= faults["sigusr1"]["at_step"]
    log = (tmp_path / "drill" / "job.log").read_text()
    assert "got USR1: forwarding to the job step" in log
    assert "training checkpointed on a stop signal (exit 75)" in log
    assert "requeueing (restart 1 of at most 3)" in log
    assert len(re.findall(r"training failed \(exit \d+\)", log)) == 2
    assert report["steps_recomputed"] == report["step_records"] - STEPS > 0
