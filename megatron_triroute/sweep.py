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
import sys
from pathlib import Path

from .config import ConfigError
from .input_errors import reports_input_errors


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


def parse_grids(specs: list[str]) -> dict[str, dict[str, list]]:
    """`--grid SYSTEM:PATH=V1,V2` flags -> {system: {path: values}}."""
    grids: dict[str, dict[str, list]] = {}
    for spec in specs:
        try:
            system, rest = spec.split(":", 1)
            path, values = rest.split("=", 1)
            grids.setdefault(system, {})[path] = [_value(v) for v in values.split(",") if v]
        except ValueError:
            raise ConfigError(f"--grid {spec!r}: expected SYSTEM:PATH=V1,V2 "
                              "(e.g. mod:router.mod_capacity=0.3,0.6)") from None
    return grids


def parse_seeds(text: str) -> list[int | None]:
    try:
        seeds = [int(s) for s in text.split(",") if s]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: expected comma-separated integers, e.g. --seeds 1,2,3") from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: a seed is repeated")
    return seeds or [None]


@reports_input_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    from .evaluation.sweep import Sweep, collect, plan_points, point_name, stale_points, train_points, write_slurm_plan
    from .training.recipes import resolve

    if "-" in args.recipe:
        raise ConfigError(f"--recipe {args.recipe}: give a scale (tiny, 160m, 410m, 1p3b); the sweep sets each system")
    base = resolve(args.recipe, list(args.overrides)).triroute
    flops_target = base.budget.flops_target if args.flops_target is None else args.flops_target
    mem_target = base.budget.mem_target if args.mem_target is None else args.mem_target
    grids = parse_grids(args.grid)
    planned = plan_points([s for s in args.systems.split(",") if s], grids, parse_seeds(args.seeds), base,
                          flops_target, mem_target)
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: must be >= 1")
    sweep = Sweep(args.recipe, args.data, args.output, list(args.overrides))
    stale = stale_points(sweep, planned)
    if stale:
        raise ConfigError("\n".join(stale))
    args.output.mkdir(parents=True, exist_ok=True)
    if args.collect:
        return collect(sweep, planned, flops_target, mem_target, args.tol)
    if args.slurm:
        plan = write_slurm_plan(sweep, planned)
        print(f"[sweep] {len(planned)} points in {plan}; submit, then collect when the array has finished:")
        print(f"  PLAN={plan.resolve()} DATA={args.data.resolve()} sbatch --array=0-{len(planned) - 1} slurm/sweep.sh")
        print(f"  {sys.executable} -m megatron_triroute.sweep --collect --recipe {args.recipe} --data {args.data} "
              f"--output {args.output} --systems {args.systems}" + "".join(f" --grid {g}" for g in args.grid) +
              (f" --seeds {args.seeds}" if args.seeds else "") + " " + " ".join(args.overrides))
        return 0
    if args.dry_run:
        for i, point in enumerate(planned):
            print(f"[sweep] {point_name(i, planned)}: {' '.join(sweep.train_command(point))}")
        return 0
    rc = train_points(sweep, planned, args.jobs)
    return rc if rc != 0 else collect(sweep, planned, flops_target, mem_target, args.tol)


if __name__ == "__main__":
    from megatron_triroute.process_exit import exit_process

    exit_process(main())
