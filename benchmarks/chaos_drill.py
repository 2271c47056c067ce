"""Chaos drill: a 2-rank Slurm training run that takes repeated faults and must end where an
uninterrupted run ends (not run in CI; a 4-fault version is tests/slurm/test_chaos_drill.py).

    python benchmarks/chaos_drill.py --local-cluster [--faults 10] [--seed S] [--steps 24] [--json]
    python benchmarks/chaos_drill.py --data DIR --reference RUN_DIR --reference-seconds S ...

The run is submitted the way users submit it (`sbatch slurm/train_1p3b.sh`, RECIPE=tiny, two CPU
tasks) and resumed after every fault until it completes. Faults, at steps drawn from a seeded RNG
(the seed is printed):

  kill_rank     SIGKILL of one rank's process (a node dying): srun ends the step, the job fails,
                the drill resubmits it.
  sigusr1       `scancel --batch --signal=USR1` (the time-limit warning): the trainer checkpoints,
                exits 75 and the job requeues itself.
  sigterm       `scancel --signal=TERM` (to every task) or `scancel --batch --signal=TERM` (to the
                batch shell, which passes it on): as USR1.
  sigterm_all   (only with --kinds) `scancel --full --signal=TERM`, TERM to every process of the job
                as a pre-emption with GraceTime sends it: srun turns a TERM of its own into a
                SIGKILL of its tasks, so the step dies without a stop checkpoint and the job is not
                requeued. Not survived: a pre-emption must signal ahead (Slurm's
                PreemptParameters=send_user_signal, or --signal=B:USR1@lead as the scripts do).
  kill_in_save  SIGKILL of one rank while a checkpoint is being written: a real kill, timed by
                watching for the save's `.tmp-step_*` directory (a save takes ~0.4-1 s here); it
                counts only if that save never committed (`latest` did not move to it).
  save_crash    the store's crash hook (TRIROUTE_CHECKPOINT_CRASH_AT=before_rename|before_latest)
                on a resubmitted job: every rank exits at that point of its first save. Those two
                windows (manifest written -> directory renamed -> `latest` moved) last microseconds:
                no signal can be timed into them.
  corrupt       between two attempts, flip bytes in or truncate one file of the newest verified
                checkpoint (only when an older verified one exists): the next attempt must fall back.

Figures: faults injected (by kind) and survived (the next attempt resumed from the newest checkpoint
that verifies, and a stop signal lost no step), steps recomputed (step records in steps.jsonl beyond
one per step), wall time lost (against the uninterrupted run's, both from submission to completion),
checkpoints lost (a committed checkpoint -- one `latest` named -- that disappeared or stopped
verifying, other than one the drill corrupted), the largest absolute difference between the final
parameters and the uninterrupted run's (both final checkpoints read with `full_model_state`) and
between their per-step losses. Exit status 1 when a target is missed (a fault not survived or not
injected, a checkpoint lost, parameters further apart than --tolerance, the run not completed),
2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_triroute.checkpoint import list_checkpoints  # noqa: E402
from megatron_triroute.checkpoint.store import CRASH_ENV, LATEST_FILE, MANIFEST_FILE, TMP_PREFIX  # noqa: E402

TRAIN_SCRIPT = REPO / "slurm" / "train_1p3b.sh"
CLUSTER_SCRIPT = REPO / "launchers" / "slurm_local_cluster.sh"
# A 2-layer, sequence-64 tiny model: ~0.1-0.2 s a step on two CPU ranks, a start-up of ~5-20 s.
DEFAULT_TRAIN_ARGS = ("train.global_batch_size=4 train.micro_batch_size=2 train.log_interval=1 "
                      "train.eval_interval=1000 train.eval_batches=2 triroute.model.n_layers=2 triroute.model.seq_len=64")
# sbatch's flags replace the GPU script's #SBATCH lines (as in docs/slurm.md for a CPU node).
CPU_FLAGS = ("--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10",
             "--signal=B:USR1@10")
# The drill checks that no committed checkpoint is lost, so it keeps them all (pruning is not a loss).
KEEP_ALL = "train.keep_last=1000000"
SCRIPT_VARIABLES = ("RECIPE", "SYSTEM", "SCALE", "RUN_DIR", "RUN_ROOT", "DATA", "TRAIN_ARGS", "SCALE_ARGS",
                    "TRIROUTE_PYTHON", "TRIROUTE_MAX_RESTARTS", CRASH_ENV)
LEAKY_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_")
LEAKY_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE"}

KINDS = ("kill_rank", "sigusr1", "kill_in_save", "corrupt", "sigterm", "save_crash")
"""In the order a fault count is spread over them: 4 faults are one of each of the first four."""
EXTRA_KINDS = ("sigterm_all",)
"""Only when named in --kinds: a TERM that srun receives too is not survived (see the docstring)."""
STOP_KINDS = {"sigusr1", "sigterm", "sigterm_all"}  # the trainer checkpoints and exits 75
FAILING = {"kill_rank", "kill_in_save", "save_crash"}  # the job fails: the drill resubmits it
BETWEEN = {"corrupt", "save_crash"}  # applied while no attempt runs (the hook: at the next submission)
CRASH_PHASES = ("before_rename", "before_latest")

ATTEMPT_END = re.compile(r"training finished: |training checkpointed on a stop signal|training failed \(exit \d+\)")
RESUMED = re.compile(r"resumed from step (\d+)")
STOPPED = re.compile(r"stop signal: checkpointed at step (\d+)")


class UsageError(Exception):
    """Bad arguments or environment: exit status 2."""


# ------------------------------------------------------------------------------------ the plan


def fault_kinds(count: int, kinds: list[str] | None = None) -> list[str]:
    """`kinds` as given, or `count` faults spread round-robin over KINDS."""
    if kinds:
        unknown = sorted(set(kinds) - set(KINDS + EXTRA_KINDS))
        if unknown:
            raise UsageError(f"unknown fault kind(s) {unknown}: choose from {', '.join(KINDS + EXTRA_KINDS)}")
        return list(kinds)
    return [KINDS[i % len(KINDS)] for i in range(count)]


def order_faults(kinds: list[str], rng: random.Random) -> list[str]:
    """A random order in which no between-attempts fault needs a running attempt: a corrupt fault
    directly follows a fault that fails the job (the drill corrupts before resubmitting), and a
    save_crash starts the drill or follows a failed job, perhaps after its corruption (the hook rides
    on a submission by the drill, never on a requeue). A save_crash fails its own job in turn."""
    order = [k for k in kinds if k not in BETWEEN]
    rng.shuffle(order)
    for kind, allowed in (("save_crash", FAILING | {"corrupt"}), ("corrupt", FAILING)):
        for _ in range(kinds.count(kind)):
            slots = [i for i in range(len(order) + 1) if (i == 0 and kind == "save_crash") or
                     (i > 0 and order[i - 1] in allowed and (i == len(order) or order[i] != kind))]
            if not slots:
                raise UsageError(f"{kinds.count(kind)} {kind} faults need as many faults before them that fail "
                                 "the job (kill_rank, kill_in_save, save_crash): add some")
            order.insert(rng.choice(slots), kind)
    return order


# ------------------------------------------------------------------------------------ records


@dataclass
class Fault:
    kind: str
    method: str = ""  # how it was delivered
    at_step: int | None = None  # completed steps when it was injected
    detail: dict = field(default_factory=dict)
    expected_resume: int | None = None  # the newest verified checkpoint after it
    resumed: int | None = None  # what the next attempt logged
    survived: bool = False
    problem: str = ""


@dataclass
class Report:
    seed: int
    steps: int
    save_every: int
    faults_requested: int
    faults: list[Fault] = field(default_factory=list)
    attempts: int = 0
    jobs: list[int] = field(default_factory=list)
    completed: bool = False
    step_records: int = 0
    steps_recomputed: int = 0
    wall_s: float = 0.0
    reference_wall_s: float = 0.0
    committed: list[int] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    max_param_diff: float = math.inf
    max_loss_diff: float = math.inf
    tolerance: float = 1e-6
    problems: list[str] = field(default_factory=list)

    def by_kind(self, survived: bool = False) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.faults:
            if f.survived or not survived:
                out[f.kind] = out.get(f.kind, 0) + 1
        return out

    def missed(self) -> list[str]:
        """Every target the drill missed, in words; empty when all were met."""
        out = list(self.problems)
        if len(self.faults) < self.faults_requested:
            out.append(f"{len(self.faults)} faults injected, {self.faults_requested} requested")
        out += [f"fault {i} ({f.kind}) not survived: {f.problem}" for i, f in enumerate(self.faults) if not f.survived]
        if self.lost:
            out.append(f"{len(self.lost)} checkpoint(s) lost: {'; '.join(self.lost)}")
        if not self.completed:
            out.append("the run did not complete")
        if not self.max_param_diff <= self.tolerance:
            out.append(f"final parameters differ by {self.max_param_diff:.3g} > {self.tolerance:g}")
        return out

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(faults_injected=self.by_kind(), faults_survived=self.by_kind(survived=True),
                   wall_lost_s=self.wall_s - self.reference_wall_s, checkpoints_lost=len(self.lost),
                   missed=self.missed())
        return out


# ------------------------------------------------------------------------------------ the store


def verified_steps(root: Path) -> list[int]:
    return [c.step for c in list_checkpoints(root, verify=True)]


def latest_step(root: Path) -> int | None:
    try:
        match = re.fullmatch(r"step_(\d+)", (root / LATEST_FILE).read_text().strip())
    except OSError:
        return None
    return int(match.group(1)) if match else None


def expected_resume(root: Path) -> int:
    """Where the next attempt must resume: the newest checkpoint that verifies, at or below the
    `latest` pointer (a directory above it was never committed); 0 when none verifies."""
    pointer = latest_step(root)
    good = [s for s in verified_steps(root) if pointer is None or s <= pointer]
    return max(good, default=0)


def corrupt_newest(root: Path, rng: random.Random) -> dict:
    """Flips bytes in, or truncates, one file of the newest verified checkpoint. Refuses (returns
    {}) unless an older verified checkpoint exists: corrupting the only one would leave nothing to
    resume."""
    good = verified_steps(root)
    pointer = latest_step(root)
    good = [s for s in good if pointer is None or s <= pointer]
    if len(good) < 2:
        return {}
    newest = root / f"step_{good[-1]:08d}"
    files = sorted(json.loads((newest / MANIFEST_FILE).read_text())["files"])
    name = rng.choice(files)
    path = newest / name
    data = bytearray(path.read_bytes())
    if rng.random() < 0.5 and len(data) > 1:
        method = "truncate"
        data = data[: rng.randrange(len(data))]
    else:
        method = "flip"
        at = rng.randrange(max(1, len(data)))
        for i in range(at, min(at + 4, len(data))):
            data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    if good[-1] in verified_steps(root):
        raise RuntimeError(f"{path} was corrupted ({method}) and still verifies")
    return {"step": good[-1], "file": name, "method": method, "fallback": good[-2]}


# ------------------------------------------------------------------------------------ the run


def step_records(run_dir: Path) -> list[dict]:
    """Every parseable step record, in write order (a record cut short by a kill is skipped)."""
    path = run_dir / "steps.jsonl"
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def rank_processes(run_dir: Path) -> dict[int, int]:
    """{rank: pid} of the trainer processes writing into run_dir (read from /proc). Only the ranks
    themselves: not the checkpoint writer each rank forks (its parent is a rank), nor such a writer
    orphaned by an earlier killed rank (its parent is init)."""
    marker = f"output_dir={run_dir}".encode()
    trainers: dict[int, tuple[int, int]] = {}  # pid -> (parent pid, rank)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            if b"megatron_triroute.train" not in argv or marker not in argv or b"python" not in Path(argv[0].decode()).name.encode():
                continue
            parent = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"SLURM_PROCID="):
                trainers[int(entry)] = (parent, int(item.split(b"=", 1)[1]))
    return {rank: pid for pid, (parent, rank) in trainers.items() if parent != 1 and parent not in trainers}


class Cluster:
    """sbatch/squeue/scancel against the cluster SLURM_CONF names."""

    def __init__(self, env: dict[str, str]):
        self.env = env

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done

    def state(self, job: int) -> str:
        return self.run("squeue", "-h", "-j", str(job), "-t", "all", "-o", "%T", check=False).stdout.strip()


def job_environment() -> dict[str, str]:
    """This environment without a launcher's variables (the drill may itself run inside a job)."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(LEAKY_PREFIXES) and k != "SLURM_CONF") and k not in LEAKY_NAMES}
    env["PATH"] = os.pathsep.join([env.get("PATH", ""), "/usr/sbin", "/sbin"])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def submit(cluster: Cluster, run_dir: Path, data: Path, train_args: str, extra_env: dict | None = None) -> int:
    env = {k: v for k, v in cluster.env.items() if k not in SCRIPT_VARIABLES}
    env.update(TRIROUTE_PYTHON=sys.executable, RECIPE="tiny", RUN_DIR=str(run_dir), DATA=str(data),
               TRAIN_ARGS=train_args, **(extra_env or {}))
    done = subprocess.run(["sbatch", "--parsable", *CPU_FLAGS, f"--output={run_dir.parent}/{run_dir.name}-%j.out",
                           str(TRAIN_SCRIPT)], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch exited {done.returncode}: {done.stdout}{done.stderr}")
    return int(done.stdout.strip().split(";")[0])


def wait_job(cluster: Cluster, job: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = cluster.state(job)
        if state in TERMINAL_STATES:
            return state
        time.sleep(0.3)
    cluster.run("scancel", str(job), check=False)
    raise RuntimeError(f"job {job} did not finish within {timeout:.0f} s")


def train_args(steps: int, save_every: int, extra: str) -> str:
    return f"train.steps={steps} train.save_interval_steps={save_every} {extra}".strip()


def reference_run(cluster: Cluster, run_dir: Path, data: Path, args: str, timeout: float) -> float:
    """The uninterrupted run; returns its wall time from submission to completion."""
    started = time.monotonic()
    state = wait_job(cluster, submit(cluster, run_dir, data, args), timeout)
    if state != "COMPLETED" or not (run_dir / "summary.json").exists():
        raise RuntimeError(f"the uninterrupted run ended {state}; see {run_dir}/job.log")
    return time.monotonic() - started


# ------------------------------------------------------------------------------------ the drill


class Drill:
    """Follows the run attempt by attempt (an attempt: one `srun` of the trainer; a job holds one
    per requeue), injecting the planned faults and checking each resume."""

    def __init__(self, cluster: Cluster, run_dir: Path, data: Path, *, steps: int, save_every: int, extra_args: str,
                 kinds: list[str], seed: int, timeout: float, say=print):
        self.cluster, self.run_dir, self.data = cluster, run_dir, data
        self.root = run_dir / "checkpoints"
        self.steps, self.save_every = steps, save_every
        self.args = train_args(steps, save_every, f"{extra_args} {KEEP_ALL}")
        self.rng = random.Random(seed)
        self.queue = order_faults(kinds, self.rng)
        self.report = Report(seed=seed, steps=steps, save_every=save_every, faults_requested=len(kinds))
        self.deadline = time.monotonic() + timeout
        self.say = say
        self.committed: set[int] = set()
        self.corrupted: set[int] = set()
        self.pending: list[Fault] = []  # injected; judged by the next attempt's resume
        self.hooked: list[Fault] = []  # save_crash faults riding on the running attempt
        self.log_offset = 0
        self.records_at_start = 0
        self.attempt_start: int | None = None  # None until the running attempt's resume step is known
        self.running = False
        self.armed: tuple[str, int] | None = None
        self.stop_checkpoint: int | None = None  # what the running attempt logged on a stop signal

    # -- what the run shows

    def new_log_lines(self) -> list[str]:
        path = self.run_dir / "job.log"
        if not path.exists():
            return []
        with open(path, "rb") as f:
            f.seek(self.log_offset)
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]  # whole lines only
        self.log_offset += len(data)
        return data.decode(errors="replace").splitlines()

    def attempt_records(self) -> list[dict]:
        return step_records(self.run_dir)[self.records_at_start:]

    def progress(self) -> int | None:
        """Steps completed so far in the running attempt's timeline (None before its first step)."""
        records = self.attempt_records()
        return records[-1]["step"] + 1 if records else None

    def follow_log(self) -> None:
        for line in self.new_log_lines():
            if "batch script started" in line:
                self.running, self.attempt_start, self.armed = True, None, None
            elif RESUMED.search(line) and self.running and self.attempt_start is None:
                self.resumed(int(RESUMED.search(line).group(1)))
            elif STOPPED.search(line):
                self.stop_checkpoint = int(STOPPED.search(line).group(1))
            elif ATTEMPT_END.search(line):
                self.attempt_ended(line)
        if self.running and self.attempt_start is None:
            records = self.attempt_records()
            if records:  # srun may forward the "resumed" line after the first step is on disk
                self.resumed(records[0]["step"])

    def note_commit(self) -> None:
        pointer = latest_step(self.root)
        if pointer is not None and pointer not in self.committed:
            self.committed.add(pointer)
            self.corrupted.discard(pointer)  # saved again over the corrupted copy

    def check_store(self) -> None:
        """Between attempts: every committed checkpoint the drill did not corrupt still verifies."""
        self.note_commit()
        good = set(verified_steps(self.root))
        pointer = latest_step(self.root)
        self.committed |= {s for s in good if pointer is not None and s <= pointer}
        for step in sorted(self.committed - self.corrupted - good):
            state = "missing" if not (self.root / f"step_{step:08d}").exists() else "fails verification"
            message = f"step_{step:08d} ({state})"
            if message not in self.report.lost:
                self.report.lost.append(message)
                self.say(f"  LOST committed checkpoint {message}")

    # -- attempt boundaries

    def resumed(self, step: int) -> None:
        self.attempt_start = step
        self.report.attempts += 1
        for fault in self.pending:
            fault.resumed = step
            if step != fault.expected_resume:
                fault.problem += f"resumed from step {step}, the newest verified checkpoint was {fault.expected_resume}; "
            fault.survived = not fault.problem
            self.say(f"  fault {self.report.faults.index(fault)} ({fault.kind}): resumed from step {step} "
                     f"(expected {fault.expected_resume}) -> {'survived' if fault.survived else 'NOT SURVIVED'}")
        self.pending = []

    def attempt_ended(self, line: str) -> None:
        """The attempt's ranks are gone (the batch script logs this after srun returned): settle
        where the next attempt must resume."""
        self.running, self.armed = False, None
        self.check_store()
        pointer = latest_step(self.root)
        for fault in self.hooked:
            fault.at_step = next((s for s in range(self.save_every, self.steps, self.save_every)
                                  if s > (self.attempt_start or 0)), self.steps)
            if "training failed" not in line:
                fault.problem += f"the crash hook did not end the attempt ({line.strip()}); "
        for fault in [f for f in self.pending if f.kind == "kill_in_save"]:
            if pointer == fault.detail["save_step"]:  # the kill came after the commit: not a kill in a save
                fault.kind, fault.method = "kill_rank", "SIGKILL (meant for a save; landed after its commit)"
                self.queue.insert(0, "kill_in_save")
        for fault in [f for f in self.pending if f.kind in STOP_KINDS]:
            # A stop signal loses no trained step: the attempt checkpoints where the signal found it.
            fault.detail.update(stop_checkpoint=self.stop_checkpoint, attempt_end=line.split("] ", 1)[-1].strip())
            if self.stop_checkpoint is None or "stop signal" not in line:
                fault.problem += f"no stop checkpoint: {fault.detail['attempt_end']}; "
            elif self.stop_checkpoint < fault.at_step:
                fault.problem += f"stop checkpoint at step {self.stop_checkpoint}, the signal came after step {fault.at_step}; "
        self.stop_checkpoint = None
        self.pending += self.hooked
        self.hooked = []
        self.records_at_start = len(step_records(self.run_dir))
        expected = expected_resume(self.root)
        for fault in self.pending:
            fault.expected_resume = expected

    # -- injection

    def arm(self) -> None:
        """Draws the step of the next live fault in the running attempt: uniformly in an equal share
        of the steps left per live fault left, so that the run does not finish before the last one."""
        kind = self.queue.pop(0)
        window = []
        for k in self.queue:
            if k not in BETWEEN:
                break
            window.append(k)
        live_left = 1 + sum(k not in BETWEEN for k in self.queue)
        low = self.attempt_start + 1
        high = max(low, self.attempt_start + (self.steps - 1 - self.attempt_start) // live_left)
        if kind in FAILING and "corrupt" in window:  # two verified checkpoints by then: one to corrupt, one to fall back to
            low = max(low, 2 * self.save_every + 1, 3 * self.save_every if kind == "kill_in_save" else 0)
        low, high = min(low, self.steps - 1), min(max(low, high), self.steps - 1)
        if kind == "kill_in_save":
            saves = [s for s in range(self.save_every, self.steps, self.save_every) if s >= low]
            near = [s for s in saves if s <= high + self.save_every - 1]
            self.armed = (kind, self.rng.choice(near or saves) if saves else self.steps)
        else:
            self.armed = (kind, self.rng.randint(low, high))

    def record(self, fault: Fault, pending: bool = True) -> None:
        self.report.faults.append(fault)
        (self.pending if pending else self.hooked).append(fault)
        where = f"at step {fault.at_step} " if fault.at_step is not None else ""
        self.say(f"  fault {len(self.report.faults) - 1}: {fault.kind} {where}({fault.method}"
                 f"{', ' + json.dumps(fault.detail) if fault.detail else ''})")

    def signal_job(self, kind: str, job: int, done: int) -> None:
        if kind == "sigusr1":
            command = ["--batch", "--signal=USR1"]
        elif kind == "sigterm":  # to the tasks (the default of --signal), or to the batch shell only
            command = [self.rng.choice(["--signal=TERM", "--batch"])]
            command += ["--signal=TERM"] if command == ["--batch"] else []
        else:  # sigterm_all: every process of the job, srun included
            command = ["--full", "--signal=TERM"]
        self.cluster.run("scancel", *command, str(job))
        self.record(Fault(kind, method=f"scancel {' '.join(command)}", at_step=done, detail={"job": job}))

    def kill_rank(self, done: int) -> bool:
        ranks = rank_processes(self.run_dir)
        if not ranks:
            return False
        rank = self.rng.choice(sorted(ranks))
        os.kill(ranks[rank], signal.SIGKILL)
        self.record(Fault("kill_rank", method="SIGKILL", at_step=done, detail={"rank": rank}))
        return True

    def kill_in_save(self, save_step: int) -> bool:
        """Waits for the save of `save_step` to start, then SIGKILLs one rank a random 0-200 ms into
        it (a save takes ~0.4-1 s here). False when the attempt got past it first."""
        tmp = self.root / f"{TMP_PREFIX}step_{save_step:08d}"
        delay, rank = self.rng.uniform(0.0, 0.2), self.rng.randrange(2)
        while not tmp.exists():
            if (self.progress() or 0) > save_step or time.monotonic() > self.deadline:
                return False
            time.sleep(0.002)
        time.sleep(delay)
        ranks = rank_processes(self.run_dir)
        if rank not in ranks or latest_step(self.root) == save_step:
            return False
        os.kill(ranks[rank], signal.SIGKILL)
        written = sum(1 for p in tmp.rglob("*") if p.is_file()) if tmp.exists() else 0
        self.record(Fault("kill_in_save", method="SIGKILL during the save", at_step=save_step,
                          detail={"rank": rank, "delay_ms": round(delay * 1000), "save_step": save_step,
                                  "files_written": written}))
        return True

    def fire(self, job: int) -> None:
        kind, at = self.armed
        done = self.progress()
        if done is None:
            return
        if kind == "kill_in_save" and done >= at - 1:
            self.armed = None
            if not self.kill_in_save(at):
                self.queue.insert(0, kind)  # missed this save: the next attempt tries again
        elif kind in STOP_KINDS and done >= at:
            self.armed = None
            self.signal_job(kind, job, done)
        elif kind == "kill_rank" and done >= at:
            self.armed = None
            if not self.kill_rank(done):
                self.queue.insert(0, kind)

    def window(self) -> dict[str, str]:
        """No attempt runs: applies the between-attempts faults at the head of the queue; returns
        the environment of the next submission (the save_crash hook)."""
        env = {}
        while self.queue and self.queue[0] in BETWEEN:
            kind = self.queue.pop(0)
            if kind == "save_crash":  # the hooked attempt runs (and fails) before the next window
                phase = self.rng.choice(CRASH_PHASES)
                env[CRASH_ENV] = phase
                self.record(Fault(kind, method=f"{CRASH_ENV}={phase}"), pending=False)
                break
            detail = corrupt_newest(self.root, self.rng)
            if not detail:  # one verified checkpoint only: keep the fault for a later window
                later = next((i + 1 for i, k in enumerate(self.queue) if k in FAILING), None)
                if later is None:
                    self.report.problems.append("a corrupt fault found no window with two verified checkpoints")
                else:
                    self.queue.insert(later, kind)
                self.say("  corrupt postponed: only one verified checkpoint")
                continue
            self.corrupted.add(detail["step"])
            self.record(Fault(kind, method=f"{detail['method']} {detail['file']}", at_step=detail["step"], detail=detail))
            expected = expected_resume(self.root)
            for fault in self.pending:  # the fault that opened this window resumes from the fallback too
                fault.expected_resume = expected
        return env

    # -- the loop

    def follow_job(self, job: int) -> str:
        """Follows one job, through its requeues, to a terminal state."""
        last_poll = 0.0
        while True:
            if time.monotonic() > self.deadline:
                self.cluster.run("scancel", str(job), check=False)
                raise RuntimeError(f"the drill ran out of time (job {job}); see {self.run_dir}/job.log")
            self.follow_log()
            self.note_commit()
            if self.running and self.attempt_start is not None:
                # One fault per attempt: none while a hooked attempt runs or a resume is still to be judged.
                if self.armed is None and self.queue and self.queue[0] not in BETWEEN and not self.pending \
                        and not self.hooked:
                    self.arm()
                if self.armed is not None:
                    self.fire(job)
            if time.monotonic() - last_poll > 0.5:
                last_poll = time.monotonic()
                state = self.cluster.state(job)
                if state in TERMINAL_STATES:
                    self.follow_log()
                    return state
            time.sleep(0.05)

    def run(self) -> Report:
        started = time.monotonic()
        env = self.window()
        while True:
            job = submit(self.cluster, self.run_dir, self.data, self.args, env)
            self.report.jobs.append(job)
            self.say(f"job {job} submitted{' with ' + ' '.join(f'{k}={v}' for k, v in env.items()) if env else ''}")
            state = self.follow_job(job)
            self.say(f"job {job} ended {state}")
            if state == "COMPLETED" and (self.run_dir / "summary.json").exists():
                break
            env = self.window()
        self.report.wall_s = time.monotonic() - started
        self.report.completed = True
        self.check_store()
        return self.report

# ------------------------------------------------------------------------------------ comparison


def final_parameters(run_dir: Path):
    from megatron_triroute.checkpoint import latest_valid_checkpoint
    from megatron_triroute.checkpoint.sharded import full_model_state
    from megatron_triroute.checkpoint.store import EXTRA_DIR

    info = latest_valid_checkpoint(run_dir / "checkpoints")
    if info is None:
        raise RuntimeError(f"no valid checkpoint in {run_dir}/checkpoints")
    with warnings.catch_warnings():  # torch DCP warns that it reads in one process, as intended here
        warnings.simplefilter("ignore", UserWarning)
        return info.step, full_model_state(info.path / EXTRA_DIR)


def compare(report: Report, run_dir: Path, reference: Path) -> None:
    step, params = final_parameters(run_dir)
    ref_step, ref_params = final_parameters(reference)
    if step != ref_step:
        report.problems.append(f"final checkpoint at step {step}, the uninterrupted run's at {ref_step}")
    if set(params) != set(ref_params):
        report.problems.append(f"parameter names differ: {sorted(set(params) ^ set(ref_params))[:5]}")
    report.max_param_diff = max(
        ((params[k].double() - ref_params[k].double()).abs().max().item() if params[k].shape == ref_params[k].shape
         else math.inf) for k in set(params) & set(ref_params))
    records = step_records(run_dir)
    report.step_records = len(records)
    report.steps_recomputed = len(records) - report.steps
    last = {r["step"]: r["loss"] for r in records}
    ref = {r["step"]: r["loss"] for r in step_records(reference)}
    if sorted(last) != sorted(ref):
        report.problems.append("the runs logged different steps")
    report.max_loss_diff = max((abs(last[s] - ref[s]) for s in set(last) & set(ref)), default=math.inf)


def print_report(report: Report) -> None:
    d = report.to_dict()
    print(f"chaos drill: seed {report.seed}, {report.steps} steps, a checkpoint every {report.save_every}")
    for i, f in enumerate(report.faults):
        print(f"  {i:2d} {f.kind:<13} step {str(f.at_step):>4}  {f.method:<40} resumed {f.resumed} "
              f"(expected {f.expected_resume})  {'ok' if f.survived else 'NOT SURVIVED: ' + f.problem}")
    print(f"faults injected:        {len(report.faults)} {d['faults_injected']}")
    print(f"faults survived:        {sum(d['faults_survived'].values())} {d['faults_survived']}")
    print(f"attempts / jobs:        {report.attempts} / {len(report.jobs)}")
    print(f"steps recomputed:       {report.steps_recomputed} ({report.step_records} step records for {report.steps} steps)")
    print(f"wall time lost:         {d['wall_lost_s']:.1f} s ({report.wall_s:.1f} s against {report.reference_wall_s:.1f} s uninterrupted)")
    print(f"checkpoints lost:       {len(report.lost)}")
    print(f"max |param difference|: {report.max_param_diff:.3g} (target <= {report.tolerance:g})")
    print(f"max |loss difference|:  {report.max_loss_diff:.3g}")
    missed = report.missed()
    print("targets: all met" if not missed else "targets MISSED:\n  " + "\n  ".join(missed))


# ------------------------------------------------------------------------------------ CLI


def build_data(directory: Path) -> Path:
    env = job_environment()
    for args in (["corpus", "--output", str(directory / "corpus"), "--max-docs", "200"],
                 ["build", "--input", str(directory / "corpus" / "*.jsonl.zst"), "--output", str(directory / "data"),
                  "--vocab-size", "1000", "--workers", "1"]):
        subprocess.run([sys.executable, "-m", "data_prep", *args], env=env, cwd=REPO, check=True, capture_output=True)
    return directory / "data"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", type=int, default=10, help="number of faults, spread over the kinds (default 10)")
    p.add_argument("--kinds", nargs="+", help=f"the exact faults instead, e.g. --kinds kill_rank corrupt ({', '.join(KINDS)})")
    p.add_argument("--seed", type=int, help="fault RNG seed (default: from the clock; printed)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=4, help="train.save_interval_steps")
    p.add_argument("--train-args", default=DEFAULT_TRAIN_ARGS, help="other key=value overrides, as in TRAIN_ARGS")
    p.add_argument("--data", type=Path, help="a data_prep output (default: build the tiny one)")
    p.add_argument("--reference", type=Path, help="an uninterrupted run of the same settings (default: train one)")
    p.add_argument("--reference-seconds", type=float, help="its wall time, submission to completion")
    p.add_argument("--work", type=Path, help="where runs go (default: a temporary directory, removed on success)")
    p.add_argument("--local-cluster", action="store_true", help="bring up launchers/slurm_local_cluster.sh first")
    p.add_argument("--tolerance", type=float, default=1e-6)
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the whole drill")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.reference and args.reference_seconds is None:
        p.error("--reference needs --reference-seconds (its submission-to-completion wall time)")
    if args.faults < 1 or args.steps < 2 * args.save_every + 2:
        p.error("need --faults >= 1 and --steps >= 2 * --save-every + 2 (two checkpoints before a corruption)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = job_environment()
    if not args.local_cluster:
        return drill_main(args, env)
    state = REPO / ".slurm-test"
    env["SLURM_CONF"] = str(state / "slurm.conf")
    cluster_env = dict(env, TRIROUTE_SLURM_DIR=str(state))
    subprocess.run(["bash", str(CLUSTER_SCRIPT), "up"], env=cluster_env, check=True, stdout=subprocess.DEVNULL)
    try:
        return drill_main(args, env)
    finally:  # the cluster this command brought up goes down with it
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "down"], env=cluster_env, stdout=subprocess.DEVNULL)


def drill_main(args, env: dict) -> int:
    if shutil.which("sbatch", path=env["PATH"]) is None:
        raise UsageError("sbatch not found: run on a Slurm cluster, or pass --local-cluster (launchers/install.sh)")
    answer = subprocess.run(["sinfo", "-h"], env=env, capture_output=True, text=True, timeout=60)
    if answer.returncode != 0:
        raise UsageError(f"no Slurm cluster answers ({answer.stderr.strip().splitlines()[-1:]}): set SLURM_CONF "
                         "or pass --local-cluster")
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    kinds = fault_kinds(args.faults, args.kinds)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    say(f"chaos drill seed {seed}: {len(kinds)} faults")
    work = args.work or Path(tempfile.mkdtemp(prefix="chaos-drill-"))
    work.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(env)
    data = args.data or build_data(work / "tiny")
    settings = train_args(args.steps, args.save_every, args.train_args)
    reference, reference_s = args.reference, args.reference_seconds
    if reference is None:
        reference = work / "reference"
        say("training the uninterrupted run")
        reference_s = reference_run(cluster, reference, data, f"{settings} {KEEP_ALL}", args.timeout)
    drill = Drill(cluster, work / "drill", data, steps=args.steps, save_every=args.save_every,
                  extra_args=args.train_args, kinds=kinds, seed=seed, timeout=args.timeout, say=say)
    try:
        report = drill.run()
    except RuntimeError as error:
        report = drill.report
        report.problems.append(str(error))
    report.reference_wall_s = reference_s
    report.tolerance = args.tolerance
    if report.completed:
        compare(report, drill.run_dir, reference)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print_report(report)
    missed = report.missed()
    if not missed and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    elif missed:
        say(f"runs kept in {work}")
    return 1 if missed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
