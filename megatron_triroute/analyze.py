"""Routing analysis of a training checkpoint over held-out tokens: PNG figures and a markdown report.

    python -m megatron_triroute.analyze --checkpoint RUN/checkpoints --output DIR [--data DIR]
        [--eval-batches N] [--clusters K] [--seed S] [--runs LABEL=RUN_DIR ...]

Runs the trainer's held-out micro-batches through the inference engine (the deployed, noise-free
priced decisions) and writes to DIR: `routing_heatmap.png` (resource spent: attention reads, real
experts, KV bits, FLOPs, by token category x depth band), `routing_clusters.png` (k-means of
routing vectors, with each cluster's most frequent tokens), `routing_mutual_information.png`
(cross-axis mutual information per layer, against a shuffled baseline), `collapse_cascade.png`
(per-axis router entropy per layer over training, from the TensorBoard logs of the `--runs` given,
by default the checkpoint's own run), `expert_load.png` (each expert's load over training, from the
same logs), `routing_report.md` with the same numbers as tables, and
`routing_analysis.json`. Needs matplotlib (the `analysis` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .command import no_grad_command


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_triroute.analyze", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a run's checkpoint root (RUN/checkpoints) or one step_* directory")
    p.add_argument("--output", required=True, type=Path, help="directory for the figures and the report")
    p.add_argument("--data", type=Path, help="the run's data directory, when its recorded data.path does not resolve")
    p.add_argument("--eval-batches", type=int, help="held-out micro-batches (default: the run's train.eval_batches)")
    p.add_argument("--clusters", type=int, default=8, help="k of k-means")
    p.add_argument("--seed", type=int, default=0, help="k-means seeding and the shuffled MI baseline")
    p.add_argument("--page-size", type=int, default=16, help="KV-cache slots per page")
    p.add_argument("--runs", action="append", default=[], metavar="LABEL=RUN_DIR",
                   help="runs whose TensorBoard entropy curves go into the collapse-cascade figure (repeatable; "
                   "default: the analysed checkpoint's own run)")
    args = p.parse_args(argv)
    for item in args.runs:
        if "=" not in item:
            p.error(f"--runs {item!r}: give LABEL=RUN_DIR (e.g. --runs full=runs/tiny --runs no-whitening=runs/nw)")
    if args.clusters < 1:
        p.error(f"--clusters={args.clusters}: must be >= 1")
    if args.eval_batches is not None and args.eval_batches < 1:
        p.error(f"--eval-batches={args.eval_batches}: must be >= 1")
    return args


def _main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: matplotlib is not installed. Fix: pip install -c constraints.txt -e '.[analysis]'", file=sys.stderr)
        return 2
    from .evaluation.loading import load_for_evaluation
    from .evaluation.perplexity import evaluation_sets
    from .evaluation.routing_report import analyse_checkpoint

    loaded = load_for_evaluation(args.checkpoint, args.data)
    batches = evaluation_sets(loaded, args.eval_batches)["valid"]
    runs = dict(item.split("=", 1) for item in args.runs)
    for path in analyse_checkpoint(loaded, batches, args.output, runs, args.clusters, args.seed, args.page_size):
        print(path)
    return 0


main = no_grad_command(_main)


if __name__ == "__main__":
    from megatron_triroute.process_exit import exit_process

    exit_process(main())
