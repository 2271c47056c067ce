"""A real one-node Slurm cluster for the session (launchers/slurm_local_cluster.sh), and helpers to
submit batch scripts and poll them with squeue."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "launchers" / "slurm_local_cluster.sh"
STATE_DIR = Path(os.environ.get("TRIROUTE_SLURM_DIR", REPO / ".slurm-test"))
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo", "munged")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
TERMINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE",
}
# Launcher variables of whatever started pytest must not leak into the jobs.
LEAKY_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_")
LEAKY_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class SlurmCluster:
    state_dir: Path
    env: dict[str, str]
    node: str

    def run(self, *command: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done

    def sbatch(self, script: Path) -> int:
        return int(self.run("sbatch", "--parsable", str(script)).stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> str:
        # -t all: finished jobs stay listed for MinJobAge.
        return self.run("squeue", "-h", "-j", str(job_id), "-t", "all", "-o", "%T", check=False).stdout.strip()

    def job_fields(self, job_id: int) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def wait_finished(self, job_id: int, timeout: float = 40) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in TERMINAL_STATES:
                return state
            time.sleep(0.5)
        self.run("scancel", str(job_id), check=False)
        raise AssertionError(f"job {job_id} still {state or 'unknown'} after {timeout} s\n{self.logs()}")

    def logs(self) -> str:
        tails = []
        for log in sorted((self.state_dir / "log").glob("*.log")):
            tails.append(f"--- {log.name} (tail)\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(tails)


def _job_environment(conf: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(LEAKY_PREFIXES) and k not in LEAKY_NAMES
    }
    env.update(
        SLURM_CONF=str(conf),
        PATH=SEARCH_PATH,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
    )
    return env


@pytest.fixture(scope="session")
def slurm_cluster():
    missing = [name for name in BINARIES if shutil.which(name, path=SEARCH_PATH) is None]
    if missing:
        message = f"Slurm binaries not found: {', '.join(missing)} (install with launchers/install.sh)"
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"{message}; CI must run the Slurm tests, not skip them")
        pytest.skip(message)
    if os.geteuid() != 0:
        pytest.fail("the local Slurm cluster needs root (slurmd launches job steps as their user)")

    env = _job_environment(STATE_DIR / "slurm.conf")
    script_env = dict(env, TRIROUTE_SLURM_DIR=str(STATE_DIR))
    status = subprocess.run(["bash", str(CLUSTER_SCRIPT), "status"], env=script_env, capture_output=True, text=True)
    already_up = status.returncode == 0
    up = subprocess.run(["bash", str(CLUSTER_SCRIPT), "up"], env=script_env, capture_output=True, text=True, timeout=90)
    if up.returncode != 0:
        pytest.fail(f"slurm_local_cluster.sh up failed:\n{up.stdout}{up.stderr}")
    node = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N"], env=env, capture_output=True, text=True, check=True
    ).stdout.split()[0]
    try:
        yield SlurmCluster(STATE_DIR, env, node)
    finally:
        if not already_up:  # leave a cluster someone else started running
            subprocess.run(["bash", str(CLUSTER_SCRIPT), "down"], env=script_env, capture_output=True, timeout=60)


@pytest.fixture
def python() -> str:
    """The interpreter jobs run (this venv's, with torch and the package's dependencies)."""
    return sys.executable


@pytest.fixture(scope="session")
def reference_run(slurm_cluster, tiny_data, tmp_path_factory):
    """`sbatch slurm/train_1p3b.sh` with the tiny recipe on 2 tasks, uninterrupted, on the session's
    `tiny_data`: what test_training_jobs.py checks first, and what the pre-emption, task-count and
    chaos drills end against. Its wall time is from submission to completion."""
    from test_training_jobs import train_job

    run_dir = tmp_path_factory.mktemp("slurm-reference") / "run"
    started = time.monotonic()
    job_id = train_job(slurm_cluster, run_dir, tiny_data)
    state = slurm_cluster.wait_finished(job_id, timeout=90)
    return {"job_id": job_id, "state": state, "run_dir": run_dir, "seconds": time.monotonic() - started}
