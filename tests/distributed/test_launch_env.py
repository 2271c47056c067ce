"""resolve_launch_env on hand-written launcher environments, plus one real mpirun."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_triroute.distributed.launch_env import (
    LaunchEnv,
    LaunchEnvError,
    expand_nodelist,
    expand_tasks_per_node,
    export_torch_env,
    resolve_launch_env,
)

REPO = Path(__file__).resolve().parents[2]

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
}

# What `srun --ntasks=6 --ntasks-per-node=2` shows task 3 (second task on the second node).
SLURM_STEP = {
    "SLURM_JOB_ID": "123457",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "6",
    "SLURM_STEP_NUM_TASKS": "6",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "2(x3)",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
    "SLURM_JOB_NODELIST": "gpu[07-08],cpu1",
    "SLURM_STEP_NODELIST": "gpu[07-08],cpu1",
}

OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_MCA_ess_base_jobid": "2130640897",
}


# --------------------------------------------------------------------------------------- torchrun


def test_torchrun():
    assert resolve_launch_env(TORCHRUN) == LaunchEnv(5, 8, 1, 4, "10.0.0.1", 29400, "torchrun")


def test_deepspeed_launcher_local_size():
    env = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"} | {"LOCAL_SIZE": "4"}
    assert resolve_launch_env(env).local_world_size == 4


def test_torchrun_wins_over_slurm_and_mpi():
    env = resolve_launch_env(SLURM_STEP | OPEN_MPI | TORCHRUN)
    assert (env.launcher, env.rank, env.master_addr) == ("torchrun", 5, "10.0.0.1")


@pytest.mark.parametrize("missing", ["RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_torchrun_incomplete_names_variable(missing):
    env = {k: v for k, v in TORCHRUN.items() if k != missing}
    with pytest.raises(LaunchEnvError, match=missing):
        resolve_launch_env(env)


def test_torchrun_missing_local_world_size():
    env = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"}
    with pytest.raises(LaunchEnvError, match="LOCAL_WORLD_SIZE"):
        resolve_launch_env(env)


def test_non_integer_rank():
    with pytest.raises(LaunchEnvError, match="RANK='zero'"):
        resolve_launch_env(TORCHRUN | {"RANK": "zero"})


def test_rank_out_of_range():
    with pytest.raises(LaunchEnvError, match=r"rank 8 not in \[0, 8\)"):
        resolve_launch_env(TORCHRUN | {"RANK": "8"})


# ------------------------------------------------------------------------------------------ Slurm


def test_slurm_step():
    # Port: 20000 + 123457 % 12768 = 20000 + 8545 (below the ephemeral range, 32768 on).
    assert resolve_launch_env(SLURM_STEP) == LaunchEnv(3, 6, 1, 2, "gpu07", 28545, "slurm")


def test_slurm_master_overrides():
    env = resolve_launch_env(SLURM_STEP | {"MASTER_ADDR": "head", "MASTER_PORT": "12345"})
    assert (env.master_addr, env.master_port, env.launcher) == ("head", 12345, "slurm")


def test_slurm_wins_over_mpi():
    assert resolve_launch_env(SLURM_STEP | OPEN_MPI).launcher == "slurm"


def test_slurm_uneven_tasks_per_node_picks_this_node():
    env = {
        "SLURM_PROCID": "4",
        "SLURM_NTASKS": "5",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "2",
        "SLURM_TASKS_PER_NODE": "2(x2),1",
        "SLURM_NODELIST": "n[1-3]",
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_ID": "0",
    }
    assert resolve_launch_env(env) == LaunchEnv(4, 5, 0, 1, "n1", 20007, "slurm")


def test_slurm_ntasks_per_node_option():
    env = {k: v for k, v in SLURM_STEP.items() if "TASKS_PER_NODE" not in k} | {"SLURM_NTASKS_PER_NODE": "2"}
    assert resolve_launch_env(env).local_world_size == 2


def test_slurm_single_node_without_tasks_per_node():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NODELIST": "vm", "SLURM_JOB_ID": "1"}
    env["SLURM_STEP_ID"] = "0"
    assert resolve_launch_env(env) == LaunchEnv(1, 2, 1, 2, "vm", 20001, "slurm")


def test_slurm_batch_script_is_not_a_rank():
    # The batch script sees SLURM_PROCID=0 and the job's task count but is one process (no step id).
    batch = {k: v for k, v in SLURM_STEP.items() if not k.startswith("SLURM_STEP")} | {"SLURM_PROCID": "0"}
    assert resolve_launch_env(batch).launcher == "single"


@pytest.mark.parametrize(
    "missing, named",
    [
        ("SLURM_LOCALID", "SLURM_LOCALID"),
        ("SLURM_JOB_ID", "SLURM_JOB_ID"),
    ],
)
def test_slurm_incomplete_names_variable(missing, named):
    env = {k: v for k, v in SLURM_STEP.items() if k != missing}
    with pytest.raises(LaunchEnvError, match=named):
        resolve_launch_env(env)


def test_slurm_without_nodelist_names_it():
    env = {k: v for k, v in SLURM_STEP.items() if "NODELIST" not in k}
    with pytest.raises(LaunchEnvError, match="SLURM_JOB_NODELIST"):
        resolve_launch_env(env)


def test_slurm_without_world_size_names_it():
    env = {k: v for k, v in SLURM_STEP.items() if k not in ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")}
    with pytest.raises(LaunchEnvError, match="SLURM_NTASKS"):
        resolve_launch_env(env)


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("vm", ["vm"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("node[1]", ["node1"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("a[1-2],b,c[3]", ["a1", "a2", "b", "c3"]),
        ("gpu-a100-[001-002].cluster", ["gpu-a100-001.cluster", "gpu-a100-002.cluster"]),
        ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
        ("10.0.0.[5-6]", ["10.0.0.5", "10.0.0.6"]),
        (" x1 , x2 ", ["x1", "x2"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[1-2", "node]1[", "node[a-b]", "node[3-1]", "n[[1]]", ""])
def test_expand_nodelist_rejects(bad):
    with pytest.raises(LaunchEnvError):
        expand_nodelist(bad)


@pytest.mark.parametrize(
    "spec, counts",
    [("2", [2]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("4,2(x2)", [4, 2, 2])],
)
def test_expand_tasks_per_node(spec, counts):
    assert expand_tasks_per_node(spec) == counts


# -------------------------------------------------------------------------------------------- MPI


def test_open_mpi_single_node():
    # All ranks on one node -> loopback; port 20000 + 2130640897 % 12768 = 20000 + 6433.
    assert resolve_launch_env(OPEN_MPI) == LaunchEnv(1, 2, 1, 2, "127.0.0.1", 26433, "mpi")


def test_open_mpi_pmix_namespace_string_is_hashed_identically():
    env = {k: v for k, v in OPEN_MPI.items() if k != "OMPI_MCA_ess_base_jobid"} | {"PMIX_NAMESPACE": "prterun-vm-41@1"}
    ports = {resolve_launch_env(env | {"OMPI_COMM_WORLD_RANK": str(r)}).master_port for r in (0, 1)}
    assert len(ports) == 1 and 20000 <= ports.pop() < 32768


def test_open_mpi_multi_node_uses_master_addr():
    env = OPEN_MPI | {"OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": "head", "MASTER_PORT": "1234"}
    assert resolve_launch_env(env) == LaunchEnv(1, 4, 1, 2, "head", 1234, "mpi")


def test_open_mpi_incomplete_names_variable():
    env = {k: v for k, v in OPEN_MPI.items() if k != "OMPI_COMM_WORLD_LOCAL_SIZE"}
    with pytest.raises(LaunchEnvError, match="OMPI_COMM_WORLD_LOCAL_SIZE"):
        resolve_launch_env(env)


def test_pmi_hydra():
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    env |= {"MASTER_ADDR": "head", "PMI_KVSNAME": "kvs_1234_0"}
    resolved = resolve_launch_env(env)
    assert (resolved.rank, resolved.world_size, resolved.local_rank, resolved.local_world_size) == (2, 4, 0, 2)
    assert (resolved.master_addr, resolved.launcher) == ("head", "mpi")


def test_pmi_missing_local_rank():
    with pytest.raises(LaunchEnvError, match="MPI_LOCALRANKID"):
        resolve_launch_env({"PMI_RANK": "0", "PMI_SIZE": "2"})


# ------------------------------------------------------------------------------- single + export


def test_single_process():
    assert resolve_launch_env({}) == LaunchEnv(0, 1, 0, 1, "127.0.0.1", 29500, "single")


def test_export_round_trips():
    environ: dict[str, str] = {}
    export_torch_env(resolve_launch_env(SLURM_STEP), environ)
    assert environ == {
        "RANK": "3",
        "WORLD_SIZE": "6",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "28545",
    }
    assert resolve_launch_env(environ) == LaunchEnv(3, 6, 1, 2, "gpu07", 28545, "torchrun")


# ------------------------------------------------------------------------------------- real mpirun

MPI_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch

    out = open(os.path.join(sys.argv[1], f"rank{os.environ['OMPI_COMM_WORLD_RANK']}.txt"), "w")  # mpirun interleaves stdout
    import torch.distributed as dist
    from megatron_triroute.distributed.launch_env import export_torch_env, resolve_launch_env

    env = resolve_launch_env()
    export_torch_env(env)
    dist.init_process_group("gloo", init_method="env://")
    total = torch.tensor([env.rank + 1.0])
    dist.all_reduce(total)
    print(f"RESULT {env.launcher} {env.rank} {env.world_size} {env.local_rank} {env.master_port} {total.item()}", file=out)
    dist.destroy_process_group()

    # Without launcher variables, an mpi4py the program already imported answers instead.
    from mpi4py import MPI
    bare = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "RANK", "WORLD", "LOCAL", "MASTER"))}
    via_mpi4py = resolve_launch_env(bare)
    assert (via_mpi4py.rank, via_mpi4py.world_size, via_mpi4py.local_rank, via_mpi4py.local_world_size) == (
        env.rank, env.world_size, env.local_rank, env.local_world_size), via_mpi4py
    print(f"MPI4PY {via_mpi4py.launcher} {via_mpi4py.master_addr} {via_mpi4py.master_port}", file=out)
    out.close()
    """
)


@pytest.mark.distributed
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_real_mpirun_two_ranks(tmp_path):
    script = tmp_path / "mpi_ranks.py"
    script.write_text(MPI_SCRIPT)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI", "PMIX_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        environ.pop(name, None)
    environ |= {
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, str(script), str(tmp_path)]
    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for rank in (0, 1) for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines()]
    results = sorted(line.split()[1:] for line in lines if line.startswith("RESULT"))
    assert [r[:4] for r in results] == [["mpi", "0", "2", "0"], ["mpi", "1", "2", "1"]]
    assert results[0][4] == results[1][4]  # both derived the same port
    assert [float(r[5]) for r in results] == [3.0, 3.0]  # (0 + 1) + (1 + 1)
    via_mpi4py = [line.split()[1:] for line in lines if line.startswith("MPI4PY")]
    assert len(via_mpi4py) == 2 and via_mpi4py[0] == via_mpi4py[1]  # rank 0's port, broadcast
    assert via_mpi4py[0][:2] == ["mpi", "127.0.0.1"]


def test_a_world_of_one_needs_no_port(tmp_path):
    """Two one-process runs on one machine, or a port another program holds, cannot collide: a
    world of one meets through an in-process store. MASTER_PORT names a port held by a listening
    socket here; the env:// rendezvous would fail on it (EADDRINUSE)."""
    import socket

    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from megatron_triroute.distributed.launch_env import init_process_group
        init_process_group("gloo", 0, 1)
        t = torch.ones(3)
        dist.all_reduce(t)
        print("SUM", t.sum().item(), dist.get_world_size(), flush=True)
        dist.destroy_process_group()
    """)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(held.getsockname()[1]), "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SUM 3.0 1" in out.stdout
