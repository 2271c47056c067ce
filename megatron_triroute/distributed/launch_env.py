"""Which rank am I, and where is rank 0? One answer for torchrun, Slurm, MPI and a bare process.

`resolve_launch_env()` reads the launcher's environment variables and returns a `LaunchEnv`.
Precedence, first match wins:

1. torchrun (and the `deepspeed` launcher, which sets the same names): `RANK` or `WORLD_SIZE` set.
2. Slurm: `SLURM_PROCID` set inside a job step (`srun`). The batch script itself is not a step.
3. MPI: `OMPI_COMM_WORLD_*` (Open MPI), `PMI_RANK`/`PMI_SIZE` (MPICH, Intel MPI), or an
   already-imported `mpi4py.MPI` with more than one process.
4. A single process.

A launcher that is detected but incomplete raises `LaunchEnvError` naming the missing variable:
guessing a rank silently is how two processes end up both believing they are rank 0.

`export_torch_env(env)` writes the torchrun names back, so `init_process_group("env://")` works
whatever the launcher was.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import zlib
from dataclasses import dataclass
from typing import Literal, Mapping, MutableMapping

Launcher = Literal["torchrun", "slurm", "mpi", "single"]

PORT_BASE = 20000
"""Derived ports live in [PORT_BASE, PORT_BASE + PORT_SPAN) = [20000, 32768): above the well-known
and registered services most clusters run and below Linux's default ephemeral range (32768-60999),
from which the kernel picks client sockets' local ports, so none of those can hold a derived port (a
span reaching 40000 once met one: EADDRINUSE); set MASTER_PORT to rule out any other program."""
PORT_SPAN = 12768

DEFAULT_SINGLE_PORT = 29500
"""torchrun's default port, exported as MASTER_PORT for a process without a launcher; its group of
one meets through an in-process store and never opens it (`init_process_group`)."""


class LaunchEnvError(RuntimeError):
    """The launcher's environment is incomplete or inconsistent; the message names the variable."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: Launcher

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise LaunchEnvError(f"{self.launcher}: world size {self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise LaunchEnvError(f"{self.launcher}: rank {self.rank} not in [0, {self.world_size})")
        if not 1 <= self.local_world_size <= self.world_size:
            raise LaunchEnvError(
                f"{self.launcher}: local world size {self.local_world_size} not in [1, {self.world_size}]"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise LaunchEnvError(
                f"{self.launcher}: local rank {self.local_rank} not in [0, {self.local_world_size})"
            )
        if not 0 < self.master_port < 65536:
            raise LaunchEnvError(f"{self.launcher}: master port {self.master_port} not in (0, 65536)")


def resolve_launch_env(environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    """Reads the launcher's variables from `environ` (see the module docstring for precedence)."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if "SLURM_PROCID" in environ and _inside_slurm_step(environ):
        return _from_slurm(environ)
    if "OMPI_COMM_WORLD_RANK" in environ or "OMPI_COMM_WORLD_SIZE" in environ:
        return _from_open_mpi(environ)
    if "PMI_RANK" in environ or "PMI_SIZE" in environ:
        return _from_pmi(environ)
    from_mpi4py = _from_initialized_mpi4py(environ)
    if from_mpi4py is not None:
        return from_mpi4py
    return LaunchEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else DEFAULT_SINGLE_PORT,
        launcher="single",
    )


def export_torch_env(env: LaunchEnv, environ: MutableMapping[str, str] = os.environ) -> None:
    """Sets the torchrun variables so `torch.distributed.init_process_group("env://")` works."""
    environ["RANK"] = str(env.rank)
    environ["WORLD_SIZE"] = str(env.world_size)
    environ["LOCAL_RANK"] = str(env.local_rank)
    environ["LOCAL_WORLD_SIZE"] = str(env.local_world_size)
    environ["MASTER_ADDR"] = env.master_addr
    environ["MASTER_PORT"] = str(env.master_port)


def init_process_group(backend: str, rank: int, world_size: int, **kwargs) -> None:
    """`torch.distributed.init_process_group` for `rank` of `world_size`. A world of one rendezvouses
    through an in-process store, not a TCP port: nothing else needs to reach it, and two
    one-process runs on one machine (or a port another program holds) cannot collide on
    `MASTER_PORT`. Larger worlds meet at `MASTER_ADDR:MASTER_PORT` (`env://`, after
    `export_torch_env`)."""
    import torch.distributed as dist

    if world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)


# ---------------------------------------------------------------------------------------- torchrun


def _from_torchrun(environ: Mapping[str, str]) -> LaunchEnv:
    world_size = _int(environ, "WORLD_SIZE", launcher="torchrun")
    # torchrun sets LOCAL_WORLD_SIZE; the deepspeed launcher sets LOCAL_SIZE instead.
    if "LOCAL_WORLD_SIZE" in environ:
        local_world_size = _int(environ, "LOCAL_WORLD_SIZE")
    elif "LOCAL_SIZE" in environ:
        local_world_size = _int(environ, "LOCAL_SIZE")
    elif world_size == 1:
        local_world_size = 1
    else:
        raise LaunchEnvError(_missing("torchrun", "LOCAL_WORLD_SIZE (or the deepspeed launcher's LOCAL_SIZE)"))
    return LaunchEnv(
        rank=_int(environ, "RANK", launcher="torchrun"),
        world_size=world_size,
        local_rank=_int(environ, "LOCAL_RANK", launcher="torchrun"),
        local_world_size=local_world_size,
        master_addr=_str(environ, "MASTER_ADDR", launcher="torchrun"),
        master_port=_int(environ, "MASTER_PORT", launcher="torchrun"),
        launcher="torchrun",
    )


# ------------------------------------------------------------------------------------------- Slurm


def _inside_slurm_step(environ: Mapping[str, str]) -> bool:
    """True inside an `srun` step. The batch script also sees SLURM_PROCID=0 and the job's
    SLURM_NTASKS, but it is one process: treating it as rank 0 of N would wait forever for the
    other N-1. Plain dict inputs without SLURM_JOB_ID (unit tests, hand-made environments) count
    as a step."""
    if "SLURM_JOB_ID" not in environ and "SLURM_JOBID" not in environ:
        return True
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    return step is not None and step not in ("batch", "extern", "interactive")


def _from_slurm(environ: Mapping[str, str]) -> LaunchEnv:
    rank = _int(environ, "SLURM_PROCID", launcher="slurm")
    # The step's task count first: `srun -n2` inside a 4-task allocation is a world of 2.
    world_var = _first_present(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    world_size = _int(environ, world_var, launcher="slurm")
    local_rank = _int(environ, "SLURM_LOCALID", launcher="slurm")

    nodelist_var = _first_present(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    nodes = expand_nodelist(_str(environ, nodelist_var, launcher="slurm")) if nodelist_var in environ else []
    local_world_size = _slurm_local_world_size(environ, world_size, n_nodes=len(nodes))

    if "MASTER_ADDR" in environ:
        master_addr = environ["MASTER_ADDR"]
    elif nodes:
        master_addr = nodes[0]  # srun's default block distribution puts rank 0 on the first node
    else:
        raise LaunchEnvError(_missing("slurm", f"MASTER_ADDR nor {nodelist_var}"))

    if "MASTER_PORT" in environ:
        master_port = _int(environ, "MASTER_PORT")
    else:
        job_var = _first_present(environ, "SLURM_JOB_ID", "SLURM_JOBID")
        master_port = port_from_job_id(_int(environ, job_var, launcher="slurm"))
    return LaunchEnv(rank, world_size, local_rank, local_world_size, master_addr, master_port, "slurm")


def _slurm_local_world_size(environ: Mapping[str, str], world_size: int, *, n_nodes: int) -> int:
    # The step's own layout first: a step may use fewer tasks than the job allocated.
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if var not in environ:
            continue
        per_node = expand_tasks_per_node(environ[var])
        if var == "SLURM_NTASKS_PER_NODE" or len(per_node) == 1:
            return per_node[0]
        node_id = _int(environ, "SLURM_NODEID", launcher="slurm")
        if node_id >= len(per_node):
            raise LaunchEnvError(f"slurm: SLURM_NODEID={node_id} but {var}={environ[var]!r} lists {len(per_node)} nodes")
        return per_node[node_id]
    if n_nodes == 1 or world_size == 1:
        return world_size
    raise LaunchEnvError(_missing("slurm", "SLURM_TASKS_PER_NODE (or SLURM_NTASKS_PER_NODE)"))


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous on this machine only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_from_job_id(job_id: int) -> int:
    """The rendezvous port every task of a job derives by itself (`launchers/env.sh` uses the
    same formula). Jobs whose ids differ by a multiple of PORT_SPAN would collide on a shared
    node; set MASTER_PORT explicitly where that matters."""
    return PORT_BASE + job_id % PORT_SPAN


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed per-node task counts: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise LaunchEnvError(f"slurm: cannot parse tasks-per-node {spec!r} (expected e.g. '2(x3),1')")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def expand_nodelist(nodelist: str, *, use_scontrol: bool = False) -> list[str]:
    """Expands a Slurm hostlist: "node[01-03,07],gpu7" -> ["node01", "node02", "node03", "node07", "gpu7"].

    Zero padding follows the range's first bound ("[08-10]" -> 08, 09, 10). Several bracket groups
    in one name expand as a product ("r[1-2]n[1-2]" -> r1n1, r1n2, r2n1, r2n2). With
    `use_scontrol=True` and `scontrol` on PATH, Slurm's own `scontrol show hostnames` is used instead.
    """
    if use_scontrol and shutil.which("scontrol"):
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True
        ).stdout
        return out.split()
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts += _expand_one(item, nodelist)
    if not hosts:
        raise LaunchEnvError(f"slurm: empty node list {nodelist!r}")
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """Splits on commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        if char == "[":
            depth += 1
            if depth > 1:
                raise LaunchEnvError(f"slurm: nested '[' in node list {nodelist!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise LaunchEnvError(f"slurm: unbalanced ']' in node list {nodelist!r}")
        elif char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise LaunchEnvError(f"slurm: unbalanced '[' in node list {nodelist!r}")
    items.append(nodelist[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_one(item: str, nodelist: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    prefix, suffix = item[: match.start()], item[match.end() :]
    hosts = []
    for value in _expand_range_set(match.group(1), nodelist):
        hosts += _expand_one(prefix + value + suffix, nodelist)
    return hosts


def _expand_range_set(ranges: str, nodelist: str) -> list[str]:
    """"01-03,07" -> ["01", "02", "03", "07"]."""
    values = []
    for part in ranges.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if match is None:
            raise LaunchEnvError(f"slurm: cannot parse range {part!r} in node list {nodelist!r}")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise LaunchEnvError(f"slurm: descending range {part!r} in node list {nodelist!r}")
        width = len(low_text)
        values += [str(n).zfill(width) for n in range(low, high + 1)]
    return values


# --------------------------------------------------------------------------------------------- MPI


def _from_open_mpi(environ: Mapping[str, str]) -> LaunchEnv:
    rank = _int(environ, "OMPI_COMM_WORLD_RANK", launcher="mpi")
    world_size = _int(environ, "OMPI_COMM_WORLD_SIZE", launcher="mpi")
    local_rank = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", launcher="mpi")
    local_world_size = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", launcher="mpi")
    job_id_var = _first_present(environ, "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")
    return _mpi_env(environ, rank, world_size, local_rank, local_world_size, job_id_var)


def _from_pmi(environ: Mapping[str, str]) -> LaunchEnv:
    # MPICH's and Intel MPI's Hydra set MPI_LOCALRANKID / MPI_LOCALNRANKS beside PMI_RANK / PMI_SIZE.
    rank = _int(environ, "PMI_RANK", launcher="mpi")
    world_size = _int(environ, "PMI_SIZE", launcher="mpi")
    local_rank = _int(environ, "MPI_LOCALRANKID", launcher="mpi")
    local_world_size = _int(environ, "MPI_LOCALNRANKS", launcher="mpi")
    job_id_var = _first_present(environ, "PMI_KVSNAME", "PMI_ID")
    return _mpi_env(environ, rank, world_size, local_rank, local_world_size, job_id_var)


def _mpi_env(
    environ: Mapping[str, str], rank: int, world_size: int, local_rank: int, local_world_size: int, job_id_var: str
) -> LaunchEnv:
    if "MASTER_ADDR" in environ:
        master_addr = environ["MASTER_ADDR"]
    elif local_world_size == world_size:
        master_addr = "127.0.0.1"  # every rank is on this node
    else:
        master_addr = _rank0_hostname_via_mpi4py()
    if "MASTER_PORT" in environ:
        master_port = _int(environ, "MASTER_PORT")
    elif job_id_var in environ:
        master_port = port_from_job_id(_job_number(environ[job_id_var]))
    else:
        raise LaunchEnvError(_missing("mpi", f"MASTER_PORT (nor {job_id_var} to derive it from)"))
    return LaunchEnv(rank, world_size, local_rank, local_world_size, master_addr, master_port, "mpi")


def _job_number(job_id: str) -> int:
    """A job id every rank sees identically, as an int: numeric ids as is, others hashed."""
    return int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())


def _rank0_hostname_via_mpi4py() -> str:
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise LaunchEnvError(
            _missing("mpi", "MASTER_ADDR (ranks span several nodes and mpi4py is not importable to find rank 0's host)")
        ) from error
    # Collective: every rank calls resolve_launch_env() at start-up, so every rank reaches this.
    return MPI.COMM_WORLD.bcast(socket.gethostname(), root=0)


def _from_initialized_mpi4py(environ: Mapping[str, str]) -> LaunchEnv | None:
    """Uses mpi4py only when the program already imported it (importing initialises MPI, which a
    plain single-process run should not pay for or risk), and only with more than one process."""
    mpi_module = sys.modules.get("mpi4py.MPI")
    if mpi_module is None:
        return None
    world = mpi_module.COMM_WORLD
    if world.Get_size() == 1:
        return None
    local = world.Split_type(mpi_module.COMM_TYPE_SHARED)
    try:
        rank, world_size = world.Get_rank(), world.Get_size()
        local_rank, local_world_size = local.Get_rank(), local.Get_size()
    finally:
        local.Free()
    if "MASTER_ADDR" in environ:
        master_addr = environ["MASTER_ADDR"]
    else:
        master_addr = world.bcast(socket.gethostname() if local_world_size < world_size else "127.0.0.1", root=0)
    if "MASTER_PORT" in environ:
        master_port = _int(environ, "MASTER_PORT")
    else:
        master_port = world.bcast(port_from_job_id(os.getpid()), root=0)
    return LaunchEnv(rank, world_size, local_rank, local_world_size, master_addr, master_port, "mpi")


# ----------------------------------------------------------------------------------------- helpers


def _first_present(environ: Mapping[str, str], *names: str) -> str:
    """The first of `names` set in `environ`; if none is, "A (or B, C)", which is in no environment
    and makes the missing-variable error name every alternative."""
    present = next((name for name in names if name in environ), None)
    if present is not None:
        return present
    return names[0] if len(names) == 1 else f"{names[0]} (or {', '.join(names[1:])})"


def _missing(launcher: str, name: str) -> str:
    return f"{launcher} launch detected but {name} is not set"


def _str(environ: Mapping[str, str], name: str, *, launcher: str = "") -> str:
    value = environ.get(name)
    if value is None or value.strip() == "":
        raise LaunchEnvError(_missing(launcher or "this", name))
    return value.strip()


def _int(environ: Mapping[str, str], name: str, *, launcher: str = "") -> int:
    value = _str(environ, name, launcher=launcher)
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"{name}={value!r} is not an integer") from None
