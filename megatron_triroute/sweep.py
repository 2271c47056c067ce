"""Matched-budget sweep: train each system over its knob(s), evaluate every point on the hard
path, trace each system's frontier and read off its point at the target budget.

    python -m megatron_triroute.sweep --recipe tiny --data data/tiny --output runs/sweep \\
        [--systems dense,mod,moe,kvquant,independent,triroute] [--flops-target F] [--mem-target M]
        [--grid SYSTEM:PATH=V1,V2 ...] [--seeds 1,2,3] [--jobs N] [--dry-run | --slurm | --collect]
        [TRAIN_OVERRIDES ...]

Each point trains recipe `SCALE-SYSTEM` (`--recipe` is the scale) with its knob overrides into
`OUTPUT/runs/SYSTEM/KNOBS` (`KNOBS/seedS` per seed with `--seeds`: `triroute.seed=S`, the
initialisation and routing noise; the data order stays the recipe's); a point whose run already finished (its `summary.json`) is not trained
again, so a stopped sweep resumes. A finished point whose saved `config.json` differs from the run
the sweep would start now (other overrides, recipe or code defaults) is refused before anything runs:
exit 2, naming the differing fields. `--slurm` writes `OUTPUT/sweep_plan.tsv` and prints the
`sbatch` command of `slurm/sweep.sh` (one array task per point, the training scripts' checkpoint /
requeue logic); `--collect` then evaluates the finished points. Outputs in `OUTPUT`: `points.csv`
(every run: knobs, seed, realised FLOPs and KV memory, held-out and tail-bucket perplexity),
`table2.md` (each system's matched point, the paper's Table 2 layout, mean ± std over seeds; the
frontiers and the read-off use the means), `frontier_flops.png` and
`frontier_mem.png` (with the `analysis` extra), `points.json`.

Default grids (`--grid` replaces a system's, one flag per knob): MoD capacity 0.4/0.55/0.7; MoE
top-k over its choices; KV-quant 2/4/8 bits; Independent capacity 0.55/0.7 x its top-k x 2/4
bits; TriRoute (and any Table 4 variant) the target pair and the pairs 0.1 below and above it.
Dense has no knob: one point, the reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .config import ConfigError
from .durability import write_text_atomic
from .input_errors import reports_input_errors

TARGET_OFFSETS = (-0.1, 0.0, 0.1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_triroute.sweep", description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="tiny", help="the scale every system is trained at (a recipe name)")
    p.add_argument("--data", required=True, type=Path, help="data_prep output directory")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--systems", default="dense,mod,moe,kvquant,independent,triroute",
                   help="comma-separated systems or Table 4 variants")
    p.add_argument("--flops-target", type=float, help="default: the recipe's budget.flops_target")
    p.add_argument("--mem-target", type=float, help="default: the recipe's budget.mem_target")
    p.add_argument("--tol", type=float, default=0.01, help="slack on both targets when reading off")
    p.add_argument("--seeds", default="", help="comma-separated triroute.seed values: every point is trained once per seed")
    p.add_argument("--jobs", type=int, default=1, help="points trained at once on this machine (local mode; each gets "
                   "OMP_NUM_THREADS = cores / jobs unless it is set)")
    p.add_argument("--grid", action="append", default=[], metavar="SYSTEM:PATH=V1,V2",
                   help="a system's values for one knob (PATH relative to triroute., e.g. mod:router.mod_capacity=0.3,0.6)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the points and their commands, train nothing")
    mode.add_argument("--slurm", action="store_true", help="write the plan for slurm/sweep.sh and print its sbatch command")
    mode.add_argument("--collect", action="store_true", help="only evaluate finished points and write the outputs")
    p.add_argument("overrides", nargs="*", help="training overrides for every point (key=value)")
    return p.parse_args(argv)


def _value(text: str):
    try:
        return int(text)
    except ValueError:
        return float(text)


def default_grid(system: str, base, flops_target: float, mem_target: float) -> list[dict]:
    """[{config path (under triroute.): value}] for one system."""
    from .systems import knobs

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


def plan_points(args, base, flops_target: float, mem_target: float) -> list[tuple[str, dict]]:
    from .systems import list_presets

    grids: dict[str, dict[str, list]] = {}
    for spec in args.grid:
        try:
            system, rest = spec.split(":", 1)
            path, values = rest.split("=", 1)
            grids.setdefault(system, {})[path] = [_value(v) for v in values.split(",") if v]
        except ValueError:
            raise ConfigError(f"--grid {spec!r}: expected SYSTEM:PATH=V1,V2 "
                              "(e.g. mod:router.mod_capacity=0.3,0.6)") from None
    points = []
    for system in [s for s in args.systems.split(",") if s]:
        if system not in list_presets():
            raise ConfigError(f"unknown system {system!r}. Fix: use some of {', '.join(list_presets())}")
        if system in grids:
            axes = [[(path, v) for v in vs] for path, vs in grids[system].items()]
            combos = [dict(c) for c in itertools.product(*axes)]
        else:
            combos = default_grid(system, base, flops_target, mem_target)
        points += [(system, combo) for combo in combos]
    return points


def run_dir_for(output: Path, system: str, knobs: dict, seed: int | None = None) -> Path:
    slug = "_".join(f"{k.rsplit('.', 1)[-1]}{v}" for k, v in knobs.items()) or "default"
    return output / "runs" / system / slug / (f"seed{seed}" if seed is not None else "")


def seeds_of(args) -> list[int | None]:
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        raise ConfigError(f"--seeds {args.seeds!r}: expected comma-separated integers, e.g. --seeds 1,2,3") from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {args.seeds!r}: a seed is repeated")
    return seeds or [None]


def recipe_for(scale: str, system: str) -> str:
    """`SCALE-SYSTEM` (the Slurm scripts' capacity planner then picks a layout for that system)."""
    return scale if system == "triroute" else f"{scale}-{system}"


def train_args(args, knobs: dict, run_dir: Path, seed: int | None = None) -> list[str]:
    return [*args.overrides, *(f"triroute.{k}={v}" for k, v in knobs.items()),
            *([f"triroute.seed={seed}"] if seed is not None else []), f"data.path={args.data}", f"output_dir={run_dir}"]


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
    from .training.resume_config import flatten

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


def refuse_stale_points(args, planned: list[tuple[str, dict, int | None]]) -> list[str]:
    """Error messages, one per finished point whose saved config.json is not the run this sweep
    would start for it; empty when every finished point can be reused."""
    from .training.recipes import resolve

    errors = []
    for system, knobs, seed in planned:
        run_dir = run_dir_for(args.output, system, knobs, seed)
        if not (run_dir / "summary.json").exists():
            continue
        fix = (f"Fix: give the sweep another --output, or delete {run_dir} to train the point again "
               f"(or run the sweep with the overrides the point was trained with).")
        saved = run_dir / "config.json"
        if not saved.exists():
            errors.append(f"{run_dir} finished but has no config.json to check it against this sweep's run. {fix}")
            continue
        wanted = resolve(recipe_for(args.recipe, system), train_args(args, knobs, run_dir, seed)).to_dict()
        differences = stale_fields(json.loads(saved.read_text()), wanted)
        if differences:
            errors.append(f"{run_dir} finished with another config than this sweep runs for it:\n  " +
                          "\n  ".join(differences) + f"\n{fix}")
    return errors


def collect(args, planned: list[tuple[str, dict, int | None]], flops_target: float, mem_target: float) -> int:
    from .evaluation.frontier import (BUCKETS, Point, average_seeds, by_system, matched_point, plot_frontiers,
                                      table2_markdown, write_csv)
    from .evaluation.loading import load_for_evaluation
    from .evaluation.perplexity import evaluate_sets, evaluation_sets

    points, missing = [], []
    for system, knobs, seed in planned:
        run_dir = run_dir_for(args.output, system, knobs, seed)
        if not (run_dir / "summary.json").exists():
            missing.append(str(run_dir))
            continue
        loaded = load_for_evaluation(run_dir / "checkpoints", args.data)
        results = {r.name: r for r in evaluate_sets(loaded.model, evaluation_sets(loaded))}
        valid = results["valid"]
        points.append(Point(system, knobs, str(run_dir), valid.realised_flops, valid.realised_mem, valid.ppl,
                            {b: results[b].ppl for b in BUCKETS if b in results and results[b].ppl is not None},
                            seed=seed))
        print(f"[sweep] evaluated {system} {points[-1].label}{'' if seed is None else f' seed {seed}'}: ppl {valid.ppl:.2f}, FLOPs {valid.realised_flops:.3f}, "
              f"KV mem {valid.realised_mem:.3f}", flush=True)
    if missing:
        print(f"[sweep] {len(missing)} point(s) not finished, left out: {', '.join(missing)}", file=sys.stderr)
    if not points:
        print("[sweep] no finished point to collect", file=sys.stderr)
        return 1
    out = args.output
    write_csv(points, out / "points.csv")
    means = average_seeds(points)
    matched = [matched_point(pts, flops_target, mem_target, args.tol) for pts in by_system(means).values()]
    (out / "table2.md").write_text(table2_markdown(matched, flops_target, mem_target))
    write_text_atomic(out / "points.json", json.dumps([p.__dict__ for p in points], indent=1))
    plots = []
    try:
        plots = plot_frontiers(means, out, flops_target, mem_target)
    except RuntimeError as error:
        print(f"[sweep] {error}", file=sys.stderr)
    print((out / "table2.md").read_text())
    print(f"[sweep] wrote {out / 'points.csv'}, {out / 'table2.md'}" + "".join(f", {p}" for p in plots))
    return 0


def train_points(args, planned: list[tuple[str, dict, int | None]]) -> int:
    """Train every planned run not finished earlier, `args.jobs` at a time (each its own process,
    its log next to its run directory); stops starting new runs after a failure."""
    from .distributed.launch_env import free_local_port

    python = sys.executable
    start, done, failed = time.time(), 0, []
    running: list[tuple[subprocess.Popen, str, Path, object]] = []
    todo = []
    for i, (system, knobs, seed) in enumerate(planned):
        run_dir = run_dir_for(args.output, system, knobs, seed)
        cmd = [python, "-m", "megatron_triroute.train", "--recipe", recipe_for(args.recipe, system),
               *train_args(args, knobs, run_dir, seed)]
        name = f"point {i + 1}/{len(planned)} {system} {knobs or ''}{'' if seed is None else f' seed {seed}'}"
        if args.dry_run:
            print(f"[sweep] {name}: {' '.join(cmd)}")
        elif (run_dir / "summary.json").exists():
            print(f"[sweep] {name}: finished earlier, {run_dir}")
        else:
            todo.append((name, run_dir, cmd))
    total = len(todo)
    while todo or running:
        while todo and len(running) < args.jobs and not failed:
            name, run_dir, cmd = todo.pop(0)
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run_dir.parent / f"{run_dir.name}.log", "ab")
            env = dict(os.environ, MASTER_PORT=str(free_local_port()))  # runs side by side: one rendezvous port each
            if args.jobs > 1 and "OMP_NUM_THREADS" not in os.environ:  # and a share of the cores each
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.jobs))
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
            done += 1
            elapsed = time.time() - start
            eta = elapsed / done * (total - done)
            print(f"[sweep] {name}: exit {proc.returncode} ({done}/{total} trained, {elapsed / 60:.1f} min elapsed, "
                  f"ETA {eta / 60:.1f} min)", flush=True)
            if proc.returncode != 0:
                failed.append(proc.returncode)
                print(f"[sweep] training failed: see {run_dir.parent / f'{run_dir.name}.log'}", file=sys.stderr)
    return failed[0] if failed else 0


@reports_input_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    from .training.recipes import resolve

    if "-" in args.recipe:
        raise ConfigError(f"--recipe {args.recipe}: give a scale (tiny, 160m, 410m, 1p3b); the sweep sets each system")
    base = resolve(args.recipe, list(args.overrides)).triroute
    flops_target = base.budget.flops_target if args.flops_target is None else args.flops_target
    mem_target = base.budget.mem_target if args.mem_target is None else args.mem_target
    planned = [(system, knobs, seed) for system, knobs in plan_points(args, base, flops_target, mem_target)
               for seed in seeds_of(args)]
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: must be >= 1")
    stale = refuse_stale_points(args, planned)
    if stale:
        raise ConfigError("\n".join(stale))
    args.output.mkdir(parents=True, exist_ok=True)
    if args.collect:
        return collect(args, planned, flops_target, mem_target)
    python = sys.executable
    if args.slurm:
        plan = args.output / "sweep_plan.tsv"
        lines = []
        for system, knobs, seed in planned:
            run_dir = run_dir_for(args.output.resolve(), system, knobs, seed)
            extra = [a for a in train_args(args, knobs, run_dir, seed) if not a.startswith(("data.path=", "output_dir="))]
            lines.append(f"{recipe_for(args.recipe, system)}\t{run_dir}\t{' '.join(extra)}")
        plan.write_text("\n".join(lines) + "\n")
        print(f"[sweep] {len(planned)} points in {plan}; submit, then collect when the array has finished:")
        print(f"  PLAN={plan.resolve()} DATA={args.data.resolve()} sbatch --array=0-{len(planned) - 1} slurm/sweep.sh")
        print(f"  {python} -m megatron_triroute.sweep --collect --recipe {args.recipe} --data {args.data} "
              f"--output {args.output} --systems {args.systems}" + "".join(f" --grid {g}" for g in args.grid) +
              (f" --seeds {args.seeds}" if args.seeds else "") + " " + " ".join(args.overrides))
        return 0
    rc = train_points(args, planned)
    if rc != 0:
        return rc
    if args.dry_run:
        return 0
    return collect(args, planned, flops_target, mem_target)


if __name__ == "__main__":
    from megatron_triroute.process_exit import exit_process

    exit_process(main())
