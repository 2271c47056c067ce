"""The preemption drill on a different task count: a 2-task job is stopped (scancel: checkpoint,
exit 75, not requeued) and the resubmitted job resumes its checkpoint on 1 task, continuing the
uninterrupted 2-task run's losses."""

import re

import pytest

from test_training_jobs import STEPS, diagnostics, job_log, steps_by_step, train_job, wait_for


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_stopped_job_resumes_on_another_task_count(slurm_cluster, tiny_data, reference_run, tmp_path):
    reference = steps_by_step(reference_run["run_dir"])
    run_dir = tmp_path / "run"
    job_id = train_job(slurm_cluster, run_dir, tiny_data, tasks=2)
    wait_for((run_dir / "checkpoints" / "latest").exists, 60, f"a checkpoint in {run_dir}")
    slurm_cluster.run("scancel", str(job_id))
    assert slurm_cluster.wait_finished(job_id, timeout=40) == "CANCELLED", diagnostics(slurm_cluster, run_dir)
    stopped = [int(s) for s in re.findall(r"stop signal: checkpointed at step (\d+)", job_log(run_dir))]
    assert stopped and stopped[-1] < STEPS

    resumed_job = train_job(slurm_cluster, run_dir, tiny_data, tasks=1)
    state = slurm_cluster.wait_finished(resumed_job, timeout=120)
    log = job_log(run_dir)
    assert state == "COMPLETED", diagnostics(slurm_cluster, run_dir)
    assert f"resumed from step {stopped[-1]}" in log
    assert "data-parallel 2 -> 1" in log
    drill = steps_by_step(run_dir)
    assert sorted(drill) == list(range(STEPS))
    for s in range(STEPS):  # the same global batches; another reduction order after the resume
        assert drill[s]["loss"] == pytest.approx(reference[s]["loss"], abs=1e-5), s
        assert drill[s]["lambdas"] == pytest.approx(reference[s]["lambdas"], abs=1e-5), s
