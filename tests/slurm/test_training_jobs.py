"""The real training batch scripts (slurm/train_*.sh, slurm/ablations.sh) on the one-node Slurm
cluster, with the tiny recipe on CPU ranks: a 2-task run to completion, a scancel that checkpoints
and stays cancelled, a two-task ablation array, and a deterministic crash that is never requeued.
Plus static checks of the scripts' headers and of the ablation list. The USR1 pre-emption (checkpoint,
exit 75, requeue, bit-exact resume) is one of the faults of test_chaos_drill.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "slurm"
TRAIN_SCRIPTS = {scale: SLURM_DIR / f"train_{scale}.sh" for scale in ("160m", "410m", "1p3b")}
ABLATIONS = SLURM_DIR / "ablations.sh"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}

STEPS = 24
SAVE_EVERY = 4
# ~0.2 s per step on two CPU ranks; a job is ~20 s, mostly imports.
TINY_ARGS = (
    f"train.steps={STEPS} train.global_batch_size=4 train.micro_batch_size=2 train.log_interval=1 "
    f"train.eval_interval=1000 train.eval_batches=2 train.save_interval_steps={SAVE_EVERY} "
    "triroute.model.n_layers=2 triroute.model.seq_len=64"
)
# sbatch's flags replace the scripts' GPU-cluster #SBATCH lines. A short --time needs a short
# --signal lead too, or the USR1 meant for "10 minutes before the limit" arrives at once.
CPU_FLAGS = ("--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=5", "--signal=B:USR1@10")
# Variables the scripts read: the outer environment must not leak into a job.
SCRIPT_VARIABLES = ("RECIPE", "SYSTEM", "SCALE", "RUN_DIR", "RUN_ROOT", "DATA", "TRAIN_ARGS", "SCALE_ARGS",
                    "REPO", "TRIROUTE_PYTHON", "TRIROUTE_MAX_RESTARTS")


def sbatch(cluster, script: Path, flags, env: dict[str, str]) -> int:
    job_env = {k: v for k, v in cluster.env.items() if k not in SCRIPT_VARIABLES}
    job_env.update(TRIROUTE_PYTHON=sys.executable, **env)
    done = subprocess.run(["sbatch", "--parsable", *flags, str(script)], env=job_env, cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"sbatch exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return int(done.stdout.strip().split(";")[0])


def train_job(cluster, run_dir: Path, data: Path, *, script: Path = TRAIN_SCRIPTS["1p3b"], tasks: int = 2,
              data_path: Path | None = None, extra: str = "") -> int:
    return sbatch(
        cluster, script, (*CPU_FLAGS, f"--ntasks-per-node={tasks}", f"--output={run_dir.parent}/{run_dir.name}-%j.out"),
        {"RECIPE": "tiny", "RUN_DIR": str(run_dir), "DATA": str(data_path or data), "TRAIN_ARGS": f"{TINY_ARGS} {extra}"},
    )


def steps_by_step(run_dir: Path) -> dict[int, dict]:
    """steps.jsonl, the last record of each step (a step can repeat after a crash between the
    record and the next checkpoint)."""
    records = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    return {record["step"]: record for record in records}


def job_log(run_dir: Path) -> str:
    return (run_dir / "job.log").read_text(errors="replace")


def diagnostics(cluster, run_dir: Path) -> str:
    tail = "\n".join(job_log(run_dir).splitlines()[-40:]) if (run_dir / "job.log").exists() else "(no job.log)"
    return f"--- {run_dir}/job.log (tail)\n{tail}\n{cluster.logs()}"


def wait_for(predicate, timeout: float, what: str, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll)
    raise AssertionError(f"not true after {timeout} s: {what}")


# ------------------------------------------------------------------------------------ static checks

def sbatch_options(script: Path) -> dict[str, str]:
    options = {}
    for line in script.read_text().splitlines():
        match = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if match:
            options[match.group(1)] = match.group(2) or ""
    return options


def minutes(limit: str) -> float:
    """Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days, _, rest = limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
        return int(days) * 1440 + h * 60 + m + s / 60
    if len(parts) == 3:
        return parts[0] * 60 + parts[1] + parts[2] / 60
    return parts[0] + (parts[1] / 60 if len(parts) == 2 else 0)


@pytest.mark.parametrize("script", [*TRAIN_SCRIPTS.values(), ABLATIONS], ids=lambda p: p.name)
def test_scripts_are_requeueable_multi_node_gpu_jobs(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    options = sbatch_options(script)
    for name in ("job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time", "signal",
                 "requeue", "open-mode", "output"):
        assert name in options, f"{script.name}: no #SBATCH --{name}"
    assert options["ntasks-per-node"] == options["gpus-per-node"], "one task per GPU"
    assert options["open-mode"] == "append"
    lead = re.fullmatch(r"B:USR1@(\d+)", options["signal"])
    assert lead, "USR1 to the batch shell, which forwards it to the step"
    assert 120 <= int(lead.group(1)) < minutes(options["time"]) * 60 / 4
    text = script.read_text()
    assert 'source "$REPO/slurm/common_train.sh"' in text and "triroute_train_job" in text


def test_train_scripts_scale_with_the_paper_recipes():
    nodes = {scale: int(sbatch_options(path)["nodes"]) for scale, path in TRAIN_SCRIPTS.items()}
    assert nodes["160m"] <= nodes["410m"] <= nodes["1p3b"]
    for scale, path in TRAIN_SCRIPTS.items():
        assert re.search(rf"^SCALE={scale}$", path.read_text(), re.M)


def test_ablation_array_is_the_python_list():
    from megatron_triroute.systems import SYSTEMS, VARIANTS

    text = ABLATIONS.read_text()
    listed = re.search(r"^ABLATIONS=\((.*?)\)", text, re.M | re.S).group(1).split()
    assert listed == list(SYSTEMS + VARIANTS)
    assert sbatch_options(ABLATIONS)["array"] == f"0-{len(listed) - 1}"


STOP_LINE = "2026-01-01 00:00:00,000 WARNING stop signal: checkpointed at step {step}, exiting with 75 for requeue\n"


@pytest.mark.parametrize("status, before, during, latest, expected", [
    # --kill-on-bad-exit terminated a rank still exiting after the stop checkpoint: resume.
    (143, "", STOP_LINE.format(step=6), "step_00000006", 75),
    (137, "", STOP_LINE.format(step=6), "step_00000006", 75),
    # The checkpoint the trainer announced is not the committed one, or there was no stop in this step.
    (143, "", STOP_LINE.format(step=6), "step_00000004", 143),
    (143, STOP_LINE.format(step=6), "", "step_00000006", 143),
    (143, "", "", None, 143),
    # Only deaths by signal are reinterpreted; ordinary statuses pass through.
    (1, "", STOP_LINE.format(step=6), "step_00000006", 1),
    (75, "", "", "step_00000006", 75),
    (0, "", "", None, 0),
], ids=["sigterm-after-stop", "sigkill-after-stop", "other-checkpoint", "stop-in-an-earlier-step", "no-stop",
        "crash-after-stop", "clean-75", "finished"])
def test_stop_status_when_srun_terminated_an_exiting_rank(tmp_path, status, before, during, latest, expected):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "job.log").write_text(before)
    if latest:
        (run_dir / "checkpoints" / "latest").write_text(latest + "\n")
    offset = len(before)
    with open(run_dir / "job.log", "a") as log:
        log.write(during)
    done = subprocess.run(
        ["bash", "-c", f'source "$REPO/slurm/common_train.sh"; triroute_stop_status {status} {offset}'],
        env={"PATH": os.environ["PATH"], "REPO": str(REPO), "RUN_DIR": str(run_dir)},
        capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == expected
    assert ("treating it as 75" in done.stderr) == (expected == 75 and status != 75)


# ------------------------------------------------------------------------------------ on the cluster

@pytest.mark.slurm
@pytest.mark.timeout(30)
def test_gpu_defaults_are_overridden_for_a_cpu_node(slurm_cluster):
    # The #SBATCH --gpus-per-node=8 of the GPU scripts cannot be met by a node without GRES (sbatch
    # rejects it at submission); sbatch's command-line flags replace it.
    for script in (*TRAIN_SCRIPTS.values(), ABLATIONS):
        plain = slurm_cluster.run("sbatch", "--test-only", str(script), check=False)
        assert plain.returncode != 0 and "gres" in plain.stderr.lower(), plain.stderr
        cpu = slurm_cluster.run("sbatch", "--test-only", *CPU_FLAGS, "--ntasks-per-node=2", str(script), check=False)
        assert cpu.returncode == 0, cpu.stderr


@pytest.mark.slurm
@pytest.mark.timeout(150)
def test_train_script_runs_to_completion(slurm_cluster, reference_run):
    run_dir, job_id = reference_run["run_dir"], reference_run["job_id"]
    assert reference_run["state"] == "COMPLETED", diagnostics(slurm_cluster, run_dir)
    fields = slurm_cluster.job_fields(job_id)
    assert (fields["Restarts"], fields["ExitCode"], fields["NumTasks"]) == ("0", "0:0", "2")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == STEPS
    lines = (run_dir / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(STEPS))  # one line per step
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
    log = job_log(run_dir)
    assert "recipe tiny -> " in log and "1 node(s) x 2 task(s)" in log
    assert "training starts at step 0" in log
    assert "training finished" in log and "step exited 0: not requeueing" in log
    assert "got USR1" not in log
    assert "finished: {" in log  # the trainer's own last line reached the per-run log


@pytest.mark.slurm
@pytest.mark.timeout(90)
def test_scancel_checkpoints_and_stays_cancelled(slurm_cluster, tiny_data, tmp_path):
    # A plain scancel SIGTERMs the step too: the trainer checkpoints and exits 75 as on a
    # pre-emption, but a job the user cancelled must not come back.
    run_dir = tmp_path / "run"
    job_id = train_job(slurm_cluster, run_dir, tiny_data, extra="train.steps=400")
    wait_for((run_dir / "checkpoints" / "latest").exists, 60, f"a checkpoint in {run_dir}")
    slurm_cluster.run("scancel", str(job_id))
    state = slurm_cluster.wait_finished(job_id, timeout=40)
    log = job_log(run_dir)
    assert state == "CANCELLED", diagnostics(slurm_cluster, run_dir)
    time.sleep(1)  # a requeue would show up as PENDING again within a second
    assert slurm_cluster.job_state(job_id) == "CANCELLED"
    assert slurm_cluster.job_fields(job_id)["Restarts"] == "0"
    stopped = re.findall(r"stop signal: checkpointed at step (\d+)", log)
    assert stopped and (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{int(stopped[-1]):08d}"
    assert "job cancelled (scancel): not requeueing" in log
    assert "requeueing (restart" not in log


def array_states(cluster, array_id: int) -> dict[str, str]:
    out = cluster.run("squeue", "-h", "-j", str(array_id), "-t", "all", "-o", "%i %T", check=False).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_ablation_array_trains_each_system_into_its_own_run_dir(slurm_cluster, tiny_data, tmp_path):
    from megatron_triroute.systems import SYSTEMS

    array_id = sbatch(
        slurm_cluster, ABLATIONS,
        (*CPU_FLAGS, "--ntasks-per-node=1", "--array=0-1", f"--output={tmp_path}/slurm-%A_%a.out"),
        {"SCALE": "tiny", "RUN_ROOT": str(tmp_path / "runs"), "DATA": str(tiny_data),
         "TRAIN_ARGS": TINY_ARGS.replace(f"train.steps={STEPS}", "train.steps=8"),
         # Must be ignored: each array task has its own recipe and run directory.
         "RECIPE": "tiny", "RUN_DIR": str(tmp_path / "shared")},
    )
    expected = {f"{array_id}_0", f"{array_id}_1"}
    deadline = time.monotonic() + 90
    states = {}
    while time.monotonic() < deadline:
        states = array_states(slurm_cluster, array_id)
        if set(states) == expected and all(s in FINAL_STATES for s in states.values()):
            break
        time.sleep(0.5)
    runs = {name: tmp_path / "runs" / f"tiny-{name}" for name in SYSTEMS[:2]}
    details = "\n".join(diagnostics(slurm_cluster, run) for run in runs.values())
    assert states == {task: "COMPLETED" for task in expected}, details
    assert not (tmp_path / "shared").exists()
    for name, run in runs.items():
        config = json.loads((run / "config.json").read_text())
        assert (config["name"], config["system"]) == (f"tiny-{name}", name)
        assert json.loads((run / "summary.json").read_text())["step"] == 8
        assert sorted(steps_by_step(run)) == list(range(8))
        assert f"recipe tiny-{name} -> {run}" in job_log(run)


@pytest.mark.slurm
@pytest.mark.timeout(90)
def test_deterministic_crash_fails_and_is_not_requeued(slurm_cluster, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    job_id = train_job(slurm_cluster, run_dir, tiny_data, data_path=tmp_path / "no-such-dataset")
    state = slurm_cluster.wait_finished(job_id, timeout=60)
    fields = slurm_cluster.job_fields(job_id)
    log = job_log(run_dir)
    assert state == "FAILED", diagnostics(slurm_cluster, run_dir)
    assert fields["Restarts"] == "0"
    assert fields["ExitCode"] not in ("0:0", "75:0")
    assert re.search(r"training failed \(exit \d+\)", log)
    assert re.search(r"step exited \d+: not requeueing", log)
    assert "requeueing (restart" not in log
    assert "no-such-dataset" in log  # the trainer's error names what is missing
