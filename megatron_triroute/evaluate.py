"""Perplexity of a training checkpoint on the held-out set and every tail bucket, on the hard path.

    python -m megatron_triroute.evaluate --checkpoint RUN/checkpoints [--data DIR] [--json]
        [--eval-batches N] [--data-parallel N] [--page-size N] [--calibrate] [--target-flops F] [--target-mem M]

Scores the sets the trainer evaluates (the held-out micro-batches and each tail bucket's windows,
`training/data.py`) with the inference engine: noise-free priced decisions, only the selected
computation. Next to each perplexity, the realised FLOPs fraction (executed attention-read +
expert MACs over the dense model's on the same tokens) and KV-memory fraction (bytes written over
a dense 16-bit cache) from the engine's cost audit. `--eval-batches` scores more (or fewer)
held-out micro-batches and bucket windows than the run's `train.eval_batches`; `--data-parallel`
replaces the data-parallel size the checkpoint was written with (the trainer rounds the count up
to a multiple of it). Progress (rate, ETA) goes to stderr; `--json` prints one object on stdout.

`--target-flops F` / `--target-mem M` score the model served at that budget (fractions of the
dense cost; either left out keeps the model's own): the prices the checkpoint's price curve gives
the targets (inference/serve_budget.py; the curve is sampled first on the run's training batches
when the checkpoint has none) price every scored sequence, and the realised fractions show how
close they land. A target the routing cannot reach exits with status 2 naming the reachable range.

A checkpoint written mid-run holds uncalibrated prices (the run calibrates them at its end) and
serves the plain argmax policy, which the budget does not hold: a budgeted TriRoute checkpoint's
evaluation says so on stderr. `--calibrate` first calibrates them as the trainer does, on the
training batches trained last before the checkpoint's step (evaluation/calibration.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .command import no_grad_command


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_triroute.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a run's checkpoint root (RUN/checkpoints) or one step_* directory")
    p.add_argument("--data", type=Path, help="the run's data directory, when its recorded data.path "
                   "(relative to where the run started) does not resolve from here")
    p.add_argument("--eval-batches", type=int, help="micro-batches per set (default: the run's train.eval_batches)")
    p.add_argument("--data-parallel", type=int, help="data-parallel size for the trainer's rounding "
                   "(default: the one that wrote the checkpoint)")
    p.add_argument("--page-size", type=int, default=16, help="KV-cache slots per page")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--calibrate", action="store_true", help="calibrate the deployed prices on the run's training "
                   "batches before the checkpoint's step first (what the run does at its end)")
    p.add_argument("--target-flops", type=float, help="score at this FLOPs fraction of dense (default: the model's own)")
    p.add_argument("--target-mem", type=float, help="score at this KV-memory fraction of dense (default: the model's own)")
    args = p.parse_args(argv)
    for name in ("eval_batches", "data_parallel"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}={value}: must be >= 1")
    return args


def _main(argv=None) -> int:
    args = parse_args(argv)
    from .evaluation.calibration import score_at_targets, serve_curve, serve_prices
    from .evaluation.loading import load_for_evaluation
    from .evaluation.perplexity import evaluate_sets, evaluation_sets, flat_metrics, total_tokens
    from .progress import Progress
    from .inference.prices import is_priced

    loaded = load_for_evaluation(args.checkpoint, args.data)
    calibration = serve_prices(loaded, args.calibrate, "pass --calibrate",
                               lambda message: print(f"warning: {message}", file=sys.stderr), args.page_size)
    targets = (args.target_flops, args.target_mem)
    curve = serve_curve(loaded, [targets], lambda message: print(f"note: {message}", file=sys.stderr), args.page_size)
    score_at_targets(loaded, curve, targets)
    sets = evaluation_sets(loaded, args.eval_batches, args.data_parallel)
    progress = Progress(total_tokens(sets))
    results = evaluate_sets(loaded.model, sets, args.page_size, progress)
    if args.json:
        print(json.dumps({"checkpoint": str(loaded.step_path), "step": loaded.step,
                          "sets": {r.name: r.to_dict() for r in results}, "metrics": flat_metrics(results),
                          "prices": loaded.prices, "calibration": calibration,
                          "targets": {"flops": targets[0], "mem": targets[1],
                                      "served_prices": loaded.model.prices.tolist()} if curve is not None else None}))
        return 0
    unpriced = is_priced(loaded.model.config) and not loaded.prices["calibrated"]
    decisions = "plain argmax: prices not calibrated" if unpriced else "noise-free priced decisions"
    print(f"checkpoint {loaded.step_path} (step {loaded.step}), hard path ({decisions})")
    if curve is not None:
        own = "the model's own"
        print(f"served at FLOPs target {own if targets[0] is None else targets[0]}, KV-memory target "
              f"{own if targets[1] is None else targets[1]} (prices {[round(p, 4) for p in loaded.model.prices.tolist()]}"
              " from the price curve)")
    print(f"{'set':<14} {'scored tokens':>13} {'perplexity':>11} {'realised FLOPs':>15} {'realised KV mem':>16}")
    for r in results:
        name = "held-out" if r.name == "valid" else r.name
        if r.ppl is None:
            print(f"{name:<14} {0:>13} {'(empty)':>11}")
        else:
            print(f"{name:<14} {r.scored_tokens:>13,} {r.ppl:>11.2f} {r.realised_flops:>15.3f} {r.realised_mem:>16.3f}")
    print("realised FLOPs: executed attention-read + expert MACs over the dense model's on the same tokens; "
          "KV mem: bytes written over a dense 16-bit cache")
    return 0


main = no_grad_command(_main)


if __name__ == "__main__":
    from megatron_triroute.process_exit import exit_process

    exit_process(main())
