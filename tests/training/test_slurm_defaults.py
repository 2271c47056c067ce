"""Every Slurm training script starts at its own default shape: each is run as sbatch would run it,
with the node and task counts of its own #SBATCH lines (and every task of an array), with
TRIROUTE_DRY_RUN=1 so it validates the exact training command it builds, layout overrides from the
capacity planner included, at that world size."""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_triroute.training.recipes import get_recipe

from .conftest import REPO

SCRIPTS = ["train_160m.sh", "train_410m.sh", "train_1p3b.sh", "ablations.sh"]


def sbatch_defaults(script: str) -> dict[str, str]:
    text = (REPO / "slurm" / script).read_text()
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", text, flags=re.M))


def array_tasks(spec: str | None) -> list[int]:
    if spec is None:
        return [None]
    lo, hi = re.match(r"(\d+)-(\d+)", spec).groups()
    return list(range(int(lo), int(hi) + 1))


def dry_run(script: str, task) -> tuple[str, subprocess.CompletedProcess]:
    shape = sbatch_defaults(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TRIROUTE_", "RECIPE", "SCALE"))}
    env.update(REPO=str(REPO), TRIROUTE_DRY_RUN="1", OMP_NUM_THREADS="1", SLURM_JOB_ID="1",
               SLURM_JOB_NUM_NODES=shape["nodes"], SLURM_NTASKS_PER_NODE=shape["ntasks-per-node"])
    if task is not None:
        env["SLURM_ARRAY_TASK_ID"] = str(task)
    for name in ("TRAIN_ARGS", "SCALE_ARGS", "SYSTEM", "DATA", "RUN_DIR", "RUN_ROOT"):
        env.pop(name, None)
    proc = subprocess.run(["bash", str(REPO / "slurm" / script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    return f"{script}[{task}]", proc


def test_every_training_script_and_array_task_dry_runs_at_its_own_shape():
    jobs = [(s, t) for s in SCRIPTS for t in array_tasks(sbatch_defaults(s).get("array"))]
    assert len(jobs) == 3 + 16
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda job: dry_run(*job), jobs))
    failures = [f"{name}: rc {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}" for name, p in results
                if p.returncode != 0 or "dry run OK" not in p.stdout]
    assert not failures, "\n\n".join(failures)
    for name, p in results:
        shape = sbatch_defaults(name.split("[")[0])
        world = int(shape["nodes"]) * int(shape["ntasks-per-node"])
        command = p.stdout.splitlines()[0]
        assert f"--world-size {world} " in command, (name, command)
        recipe = re.search(r"--recipe (\S+)", command).group(1)
        router = get_recipe(recipe).triroute.router
        if router.expert_routing and router.num_experts > 1:
            # The planner's layout shards the experts inside a node, as widely as the experts allow.
            ep = max(d for d in range(1, int(shape["ntasks-per-node"]) + 1) if router.num_experts % d == 0)
            assert ep > 1 and f"parallel.expert={ep} " in command, (name, command)
            assert f"expert parallel {ep} " in p.stdout, (name, p.stdout[-800:])


@pytest.mark.parametrize("script", ["train_1p3b.sh"])
def test_the_planner_picks_what_the_script_runs(script):
    """The layout the script passes is the planner's pick for the script's own shape."""
    shape = sbatch_defaults(script)
    _, proc = dry_run(script, None)
    command = proc.stdout.splitlines()[0]
    recipe = re.search(r"--recipe (\S+)", command).group(1)
    pick = subprocess.run(
        [sys.executable, "-m", "megatron_triroute.train", "--recipe", recipe, "--plan", "--overrides-only",
         "--nodes", shape["nodes"], "--gpus-per-node", shape["ntasks-per-node"]],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert pick.returncode == 0, pick.stderr[-2000:]
    assert pick.stdout.strip() in command, (pick.stdout, command)
