"""The matched-budget sweep (`python -m megatron_triroute.sweep`): which runs it trains and where,
whether a finished run can be reused, training the runs side by side, and collecting the finished
ones into points, frontiers and the read-off (`frontier.py`).

A planned point is one system at one knob setting (config paths under `triroute.`), trained once per
seed with recipe `SCALE-SYSTEM` into `OUTPUT/runs/SYSTEM/KNOBS[/seedS]`; its `summary.json` marks it
finished.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..config import ConfigError
from ..durability import write_text_atomic
from ..progress import Progress

TARGET_OFFSETS = (-0.1, 0.0, 0.1)
"""TriRoute's default grid: the target pair and the pairs this far below and above it."""


class PlannedPoint(NamedTuple):
    system: str
    knobs: dict
    """Config path (under `triroute.`) -> value; empty for a system without knobs."""
    seed: int | None = None
    """`triroute.seed` of the run (None: the recipe's)."""


@dataclass
class Sweep:
    """What every point of one sweep shares."""

    scale: str
    """The recipe scale every system is trained at (tiny, 160m, ...)."""
    data: Path
    output: Path
    overrides: list[str]
    """Training overrides (key=value) for every point."""

    def run_dir(self, point: PlannedPoint, output: Path | None = None) -> Path:
        return run_dir_for(self.output if output is None else output, *point)

    def recipe(self, point: PlannedPoint) -> str:
        return recipe_for(self.scale, point.system)

    def train_args(self, point: PlannedPoint, run_dir: Path) -> list[str]:
        """The point's overrides for `megatron_triroute.train`, its data and output directory last."""
        return [*self.overrides, *(f"triroute.{k}={v}" for k, v in point.knobs.items()),
                *([f"triroute.seed={point.seed}"] if point.seed is not None else []),
                f"data.path={self.data}", f"output_dir={run_dir}"]

    def train_command(self, point: PlannedPoint) -> list[str]:
        return [sys.executable, "-m", "megatron_triroute.train", "--recipe", self.recipe(point),
                *self.train_args(point, self.run_dir(point))]

    def finished(self, point: PlannedPoint) -> bool:
        return (self.run_dir(point) / "summary.json").exists()


def default_grid(system: str, base, flops_target: float, mem_target: float) -> list[dict]:
    """[{config path (under triroute.): value}] for one system."""
    from ..systems import knobs

    ks = {k.path: k for k in knobs(system, base)}
    if not ks:
        return [{}]
    if "budget.flops_target" in ks:
        return [{"budget.flops_target": round(flops_target + d, 4), "budget.mem_target": round(mem_target + d, 4)}
                for d in TARGET_OFFSETS if 0 < flops_target + d <= 1 and 0 < mem_target + d <= 1]
    multi = len(ks) > 1  # the Independent combo: a small grid over its three knobs

    def values(knob) -> tuple:
        if knob.path == "router.mod_capacity":
            return (0.55, 0.7) if multi else (0.4, 0.55, 0.7)
        if knob.path == "router.top_k":
            return (knob.default,) if multi else knob.choices
        if knob.path == "router.uniform_bits":
            return (2, 4) if multi else (2, 4, 8)
        raise ConfigError(f"no default grid for knob {knob.path}. Fix: pass --grid {system}:{knob.path}=V1,V2")

    axes = [[(k.path, v) for v in values(k)] for k in ks.values()]
    return [dict(combo) for combo in itertools.product(*axes)]


def plan_points(systems: list[str], grids: dict[str, dict[str, list]], seeds: list[int | None], base,
                flops_target: float, mem_target: float) -> list[PlannedPoint]:
    """Every run: each system over its grid (`grids[system]`, config path -> values, else its
    default grid), each setting once per seed."""
    from ..systems import list_presets

    combos = []
    for system in systems:
        if system not in list_presets():
            raise ConfigError(f"unknown system {system!r}. Fix: use some of {', '.join(list_presets())}")
        if system in grids:
            axes = [[(path, v) for v in vs] for path, vs in grids[system].items()]
            combos += [(system, dict(c)) for c in itertools.product(*axes)]
        else:
            combos += [(system, c) for c in default_grid(system, base, flops_target, mem_target)]
    return [PlannedPoint(system, knobs, seed) for system, knobs in combos for seed in seeds]


def run_dir_for(output: Path, system: str, knobs: dict, seed: int | None = None) -> Path:
    slug = "_".join(f"{k.rsplit('.', 1)[-1]}{v}" for k, v in knobs.items()) or "default"
    return output / "runs" / system / slug / (f"seed{seed}" if seed is not None else "")


def recipe_for(scale: str, system: str) -> str:
    """`SCALE-SYSTEM` (the Slurm scripts' capacity planner then picks a layout for that system)."""
    return scale if system == "triroute" else f"{scale}-{system}"


SAME_POINT = {
    "output_dir": "the point's own directory, however --output is spelled",
    "triroute.model.vocab_size": "set from the data's tokenizer when training starts",
    # The layout the Slurm scripts' capacity planner picks for each allocation
    # (training/planner.py, Candidate.overrides): the same model and updates.
    "parallel.tensor": "parallel layout", "parallel.pipeline": "parallel layout",
    "parallel.expert": "parallel layout", "train.micro_batch_size": "parallel layout",
    "train.recompute": "parallel layout",
}
"""Config fields a finished point may differ in from the sweep's run and still be that point."""


def stale_fields(saved: dict, wanted: dict) -> list[str]:
    """One line per field where a finished point's saved config (`RunConfig.to_dict()` tree) differs
    from the run the sweep would start; data.path compares as the directory it names."""
    from ..training.resume_config import flatten

    before, after = flatten(saved), flatten(wanted)
    lines = []
    for field in sorted(before.keys() | after.keys()):
        old, now = before.get(field, "<absent>"), after.get(field, "<absent>")
        if field in SAME_POINT or old == now:
            continue
        if field == "data.path" and Path(str(old)).resolve() == Path(str(now)).resolve():
            continue
        lines.append(f"{field}: trained with {old!r}, the sweep now runs {now!r}")
    return lines


def stale_points(sweep: Sweep, planned: list[PlannedPoint]) -> list[str]:
    """Error messages, one per finished point whose saved config.json is not the run this sweep
    would start for it; empty when every finished point can be reused."""
    from ..training.recipes import resolve

    errors = []
    for point in planned:
        run_dir = sweep.run_dir(point)
        if not sweep.finished(point):
            continue
        fix = (f"Fix: give the sweep another --output, or delete {run_dir} to train the point again "
               f"(or run the sweep with the overrides the point was trained with).")
        saved = run_dir / "config.json"
        if not saved.exists():
            errors.append(f"{run_dir} finished but has no config.json to check it against this sweep's run. {fix}")
            continue
        wanted = resolve(sweep.recipe(point), sweep.train_args(point, run_dir)).to_dict()
        differences = stale_fields(json.loads(saved.read_text()), wanted)
        if differences:
            errors.append(f"{run_dir} finished with another config than this sweep runs for it:\n  " +
                          "\n  ".join(differences) + f"\n{fix}")
    return errors


def point_name(i: int, planned: list[PlannedPoint]) -> str:
    system, knobs, seed = planned[i]
    return f"point {i + 1}/{len(planned)} {system} {knobs or ''}{'' if seed is None else f' seed {seed}'}"


def write_slurm_plan(sweep: Sweep, planned: list[PlannedPoint]) -> Path:
    """`OUTPUT/sweep_plan.tsv`, one line per point for slurm/sweep.sh: RECIPE <tab> RUN_DIR (absolute)
    <tab> the point's overrides (data.path and output_dir come from the script)."""
    lines = []
    for point in planned:
        run_dir = sweep.run_dir(point, sweep.output.resolve())
        extra = [a for a in sweep.train_args(point, run_dir) if not a.startswith(("data.path=", "output_dir="))]
        lines.append(f"{sweep.recipe(point)}\t{run_dir}\t{' '.join(extra)}")
    plan = sweep.output / "sweep_plan.tsv"
    write_text_atomic(plan, "\n".join(lines) + "\n")
    return plan


def train_points(sweep: Sweep, planned: list[PlannedPoint], jobs: int) -> int:
    """Train every planned run not finished earlier, `jobs` at a time (each its own process, its log
    next to its run directory); stops starting new runs after a failure. Returns the first failed
    run's exit status, else 0."""
    failed = []
    running: list[tuple[subprocess.Popen, str, Path, object]] = []
    todo = []
    for i, point in enumerate(planned):
        name, run_dir = point_name(i, planned), sweep.run_dir(point)
        if sweep.finished(point):
            print(f"[sweep] {name}: finished earlier, {run_dir}")
        else:
            todo.append((name, run_dir, sweep.train_command(point)))
    progress = Progress(len(todo), "runs", "sweep", stream=sys.stdout)
    while todo or running:
        while todo and len(running) < jobs and not failed:
            name, run_dir, cmd = todo.pop(0)
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run_dir.parent / f"{run_dir.name}.log", "ab")
            env = dict(os.environ)  # runs side by side need no port each: a world of one meets in-process
            if jobs > 1 and "OMP_NUM_THREADS" not in os.environ:  # and a share of the cores each
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), name, run_dir, log))
        if not running:
            break
        time.sleep(0.5)
        for item in list(running):
            proc, name, run_dir, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            progress.update(1, f"{name}: exit {proc.returncode}", force=True)
            if proc.returncode != 0:
                failed.append(proc.returncode)
                print(f"[sweep] training failed: see {run_dir.parent / f'{run_dir.name}.log'}", file=sys.stderr)
    return failed[0] if failed else 0


def collect(sweep: Sweep, planned: list[PlannedPoint], flops_target: float, mem_target: float, tol: float) -> int:
    """Evaluate every finished point on the hard path and write `points.csv`, `points.json`,
    `table2.md` (each system's matched point over the seed means) and the frontier plots (with
    matplotlib) into the output directory; 1 when no point has finished."""
    from .frontier import (BUCKETS, Point, average_seeds, by_system, matched_point, plot_frontiers, table2_markdown,
                           write_csv)
    from .loading import load_for_evaluation
    from .perplexity import evaluate_sets, evaluation_sets

    points, missing = [], []
    for point in planned:
        system, knobs, seed = point
        run_dir = sweep.run_dir(point)
        if not sweep.finished(point):
            missing.append(str(run_dir))
            continue
        loaded = load_for_evaluation(run_dir / "checkpoints", sweep.data)
        results = {r.name: r for r in evaluate_sets(loaded.model, evaluation_sets(loaded))}
        valid = results["valid"]
        points.append(Point(system, knobs, str(run_dir), valid.realised_flops, valid.realised_mem, valid.ppl,
                            {b: results[b].ppl for b in BUCKETS if b in results and results[b].ppl is not None},
                            seed=seed))
        print(f"[sweep] evaluated {system} {points[-1].label}{'' if seed is None else f' seed {seed}'}: "
              f"ppl {valid.ppl:.2f}, FLOPs {valid.realised_flops:.3f}, KV mem {valid.realised_mem:.3f}", flush=True)
    if missing:
        print(f"[sweep] {len(missing)} point(s) not finished, left out: {', '.join(missing)}", file=sys.stderr)
    if not points:
        print("[sweep] no finished point to collect", file=sys.stderr)
        return 1
    out = sweep.output
    write_csv(points, out / "points.csv")
    means = average_seeds(points)
    matched = [matched_point(pts, flops_target, mem_target, tol) for pts in by_system(means).values()]
    table = table2_markdown(matched, flops_target, mem_target)
    write_text_atomic(out / "table2.md", table)
    write_text_atomic(out / "points.json", json.dumps([p.__dict__ for p in points], indent=1))
    plots = []
    try:
        plots = plot_frontiers(means, out, flops_target, mem_target)
    except RuntimeError as error:
        print(f"[sweep] {error}", file=sys.stderr)
    print(table)
    print(f"[sweep] wrote {out / 'points.csv'}, {out / 'table2.md'}" + "".join(f", {p}" for p in plots))
    return 0
