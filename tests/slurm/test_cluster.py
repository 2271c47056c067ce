"""End to end on a real one-node Slurm: a 2-task gloo job, a USR1 pre-emption drill that checkpoints,
requeues and resumes, and the requeue cap."""

from __future__ import annotations

import json
import random
import textwrap
import time
from pathlib import Path

import pytest

from megatron_triroute.distributed.launch_env import expand_nodelist, port_from_job_id

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
ENV_SH = REPO / "launchers" / "env.sh"


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_nodelist_expansion_agrees_with_scontrol(slurm_cluster):
    nodelist = "node[01-03,07],gpu[8-10],r[1-2]n[1,3],x"
    shown = slurm_cluster.run("scontrol", "show", "hostnames", nodelist).stdout.split()
    assert expand_nodelist(nodelist) == shown


# ------------------------------------------------------------------------------ 2-task gloo job

ALL_REDUCE = """
import json, os, sys
import torch
import torch.distributed as dist
from megatron_triroute.distributed.launch_env import export_torch_env, resolve_launch_env

env = resolve_launch_env()  # from SLURM_PROCID / SLURM_NTASKS / SLURM_JOB_NODELIST / SLURM_JOB_ID only
export_torch_env(env)
dist.init_process_group("gloo", init_method="env://")
total = torch.tensor([float(env.rank + 1)])
dist.all_reduce(total)
with open(os.path.join(sys.argv[1], f"rank_{env.rank}.json"), "w") as out:
    json.dump({**env.__dict__, "sum": total.item()}, out)
dist.destroy_process_group()
"""


def test_two_task_job_all_reduces_over_gloo(slurm_cluster, python, tmp_path):
    write(tmp_path / "all_reduce.py", ALL_REDUCE)
    batch = write(
        tmp_path / "job.sh",
        f"""
        #!/bin/bash
        #SBATCH --job-name=triroute-smoke
        #SBATCH --ntasks=2
        #SBATCH --time=2
        #SBATCH --output={tmp_path}/slurm-%j.out
        srun --ntasks=2 --kill-on-bad-exit=1 {python} {tmp_path}/all_reduce.py {tmp_path}
        """,
    )
    job_id = slurm_cluster.sbatch(batch)
    state = slurm_cluster.wait_finished(job_id)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert state == "COMPLETED", output

    # Completed jobs are recorded without slurmdbd (JobCompType=jobcomp/filetxt, read by `sacct -c`).
    accounted = slurm_cluster.run("sacct", "-c", "-n", "-j", str(job_id), "-o", "State").stdout.split()
    assert accounted == ["COMPLETED"]

    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    for rank, seen in enumerate(ranks):
        assert seen == {
            "rank": rank,
            "world_size": 2,
            "local_rank": rank,
            "local_world_size": 2,
            "master_addr": slurm_cluster.node,
            "master_port": port_from_job_id(job_id),
            "launcher": "slurm",
            "sum": 3.0,  # (0 + 1) + (1 + 1)
        }


# ------------------------------------------------------------------------------ pre-emption drill

# A stand-in for the trainer: one random draw per step, a checkpoint when a stop signal arrived.
TRAINER = """
import os, random, sys, time
from megatron_triroute.training.signals import EXIT_FINISHED, EXIT_REQUEUE, install_stop_handlers, stop_requested
install_stop_handlers()  # before the slow imports below

from pathlib import Path
from megatron_triroute.checkpoint import (
    capture_rng_state, latest_valid_checkpoint, load_checkpoint, restore_rng_state, save_checkpoint,
)

run_dir, total_steps, step_seconds = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
ckpt = run_dir / "ckpt"
if latest_valid_checkpoint(ckpt) is not None:
    start, state, meta = load_checkpoint(ckpt)
    restore_rng_state(state["rng"])
    print(f"resumed after step {start}", flush=True)
else:
    random.seed(1234)
    start = 0

with open(run_dir / "steps.log", "a") as steps:
    for step in range(start + 1, total_steps + 1):
        value = random.random()
        steps.write(f"{step} {value!r} {restart}\\n")
        steps.flush()
        time.sleep(step_seconds)
        if stop_requested():
            save_checkpoint(ckpt, step, {"rng": capture_rng_state()}, {"step": step}, keep_last=2)
            print(f"checkpointed step {step}; exiting {EXIT_REQUEUE}", flush=True)
            sys.exit(EXIT_REQUEUE)
print("finished", flush=True)
sys.exit(EXIT_FINISHED)
"""

# The batch-script pattern slurm/train_*.sh follow: env.sh does the signal forwarding and requeue.
BATCH = """
#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --ntasks=1
#SBATCH --time=5
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@60
#SBATCH --output={run_dir}/slurm-%j.out
source {env_sh}
export TRIROUTE_MAX_RESTARTS={max_restarts}
triroute_append_log {run_dir}/job.log
triroute_slurm_env
triroute_srun --ntasks=1 --kill-on-bad-exit=1 {command}
status=$?
triroute_requeue_if_needed "$status"
exit "$status"
"""


def submit(cluster, run_dir: Path, command: str, *, name: str, max_restarts: int) -> int:
    script = write(
        run_dir / "job.sh",
        BATCH.format(name=name, run_dir=run_dir, env_sh=ENV_SH, max_restarts=max_restarts, command=command),
    )
    return cluster.sbatch(script)


def wait_for_lines(path: Path, count: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} has fewer than {count} lines after {timeout} s")


def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, python, tmp_path):
    total_steps = 40
    write(tmp_path / "trainer.py", TRAINER)
    job_id = submit(
        slurm_cluster, tmp_path, f"{python} {tmp_path}/trainer.py {tmp_path} {total_steps} 0.1",
        name="triroute-drill", max_restarts=2,
    )
    steps_log = tmp_path / "steps.log"
    wait_for_lines(steps_log, 3)  # the trainer is in its loop
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", str(job_id))

    state = slurm_cluster.wait_finished(job_id)
    job_log = (tmp_path / "job.log").read_text()
    assert state == "COMPLETED", job_log
    assert slurm_cluster.job_fields(job_id)["Restarts"] == "1"

    lines = [line.split() for line in steps_log.read_text().splitlines()]
    interrupted_at = max(int(step) for step, _, restart in lines if restart == "0")
    assert 3 <= interrupted_at < total_steps
    # Every step ran exactly once, in order, split across the two runs at the checkpoint...
    assert [int(step) for step, _, _ in lines] == list(range(1, total_steps + 1))
    assert [restart for _, _, restart in lines] == ["0"] * interrupted_at + ["1"] * (total_steps - interrupted_at)
    # ...and drew the same random numbers as an uninterrupted run.
    random.seed(1234)
    assert [float(value) for _, value, _ in lines] == [random.random() for _ in range(total_steps)]

    assert "got USR1: forwarding to the job step" in job_log
    assert "requeueing (restart 1 of at most 2)" in job_log
    assert f"resumed after step {interrupted_at}" in job_log
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step_{interrupted_at:08d}"


def test_requeue_stops_at_the_restart_cap(slurm_cluster, tmp_path):
    # A step that always exits 75 ("checkpointed, resume me") is requeued max_restarts times, no more.
    job_id = submit(slurm_cluster, tmp_path, "bash -c 'exit 75'", name="triroute-cap", max_restarts=1)
    assert slurm_cluster.wait_finished(job_id) == "FAILED"
    fields = slurm_cluster.job_fields(job_id)
    assert (fields["Restarts"], fields["ExitCode"]) == ("1", "75:0")
    job_log = (tmp_path / "job.log").read_text()
    assert job_log.count("requeueing (restart") == 1
    assert "already restarted 1 times (max 1): not requeueing" in job_log


def test_failure_is_never_requeued(slurm_cluster, tmp_path):
    job_id = submit(slurm_cluster, tmp_path, "bash -c 'exit 3'", name="triroute-fail", max_restarts=3)
    assert slurm_cluster.wait_finished(job_id) == "FAILED"
    fields = slurm_cluster.job_fields(job_id)
    assert (fields["Restarts"], fields["ExitCode"]) == ("0", "3:0")
    assert "step exited 3: not requeueing" in (tmp_path / "job.log").read_text()
