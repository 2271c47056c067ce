"""One model, any budget: a trained TriRoute checkpoint served at several (FLOPs, KV-memory) targets.

    python benchmarks/bench_serve_budget.py --checkpoint runs/tiny/checkpoints [--data DIR] \
        [--budgets 0.35,0.25 0.5,0.35 ... 1,1] [--prompts 8] [--prompt-tokens 16] [--new-tokens 64] \
        [--output docs/results/serve_budget]

For each budget (targets the routing cannot reach are reported and skipped):
- held-out and bucket perplexity (evaluation/perplexity.py) with the prices the price curve gives
  the targets, and the realised fractions there;
- generation from held-out prompts (the first `--prompt-tokens` tokens of validation sequences),
  `--new-tokens` greedy tokens each, every request at the budget: per request the realised
  fractions over its generated tokens, with the per-request control (the engine's default) and
  with the curve's prices alone; decode tokens/s of the batch.
Then one mixed-budget batch (request i at budget i mod the feasible budgets): per request target
against realised. Writes OUTPUT.csv (per budget), OUTPUT_mixed.csv, OUTPUT.json and OUTPUT.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

DEFAULT_BUDGETS = ("0.35,0.25", "0.45,0.25", "0.5,0.3", "0.55,0.4", "0.65,0.5", "0.8,0.7", "0.9,0.85", "1,1")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", type=Path)
    p.add_argument("--budgets", nargs="+", default=list(DEFAULT_BUDGETS), help="FLOPS,MEM target pairs")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--eval-batches", type=int, default=None)
    p.add_argument("--output", type=Path, default=Path("docs/results/serve_budget"))
    return p.parse_args(argv)


def held_out_prompts(sets: dict, n: int, length: int) -> list[list[int]]:
    rows = [row[:length].tolist() for mb in sets["valid"] for row in mb.tokens]
    if len(rows) < n:
        raise SystemExit(f"only {len(rows)} held-out sequences; ask for --prompts {len(rows)} or fewer")
    return rows[:n]


def serve(model, curve, prompts, targets, new_tokens, control=True):
    from megatron_triroute.inference.engine import InferenceEngine

    engine = InferenceEngine(model, price_curve=curve, control=control)
    start = time.perf_counter()
    done = engine.run(prompts, new_tokens, None, targets)
    seconds = time.perf_counter() - start
    return engine, done, sum(len(r.generated) for r in done) / seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_triroute.evaluation.calibration import curve_loaded
    from megatron_triroute.evaluation.loading import load_for_evaluation
    from megatron_triroute.evaluation.perplexity import evaluate_sets, evaluation_sets

    torch.set_grad_enabled(False)
    loaded = load_for_evaluation(args.checkpoint, args.data)
    model = loaded.model
    own = model.prices.clone()
    t0 = time.perf_counter()
    curve = curve_loaded(loaded)
    curve_s = time.perf_counter() - t0
    sets = evaluation_sets(loaded, args.eval_batches)
    prompts = held_out_prompts(sets, args.prompts, args.prompt_tokens)
    budgets = [tuple(float(x) for x in b.split(",")) for b in args.budgets]
    rows, feasible = [], []
    for target in budgets:
        try:
            for r in range(2):
                curve.check(r, target[r])
        except ValueError as error:
            print(f"budget {target}: {error}", file=sys.stderr)
            rows.append({"target_flops": target[0], "target_mem": target[1], "feasible": False})
            continue
        feasible.append(target)
        model.prices.copy_(torch.tensor([curve.price_for(0, target[0]), curve.price_for(1, target[1])],
                                        dtype=torch.float64))
        results = {r.name: r for r in evaluate_sets(model, sets)}
        model.prices.copy_(own)
        row = {"target_flops": target[0], "target_mem": target[1], "feasible": True,
               "price_flops": float(curve.price_for(0, target[0])), "price_mem": float(curve.price_for(1, target[1]))}
        for name, res in results.items():
            row[f"{name}_ppl"] = res.ppl
            row[f"{name}_realised_flops"] = res.realised_flops
            row[f"{name}_realised_mem"] = res.realised_mem
        for control in (True, False):
            engine, done, tps = serve(model, curve, prompts, [target] * len(prompts), args.new_tokens, control)
            real = torch.tensor([engine.realised(r.rid) for r in done], dtype=torch.float64)
            err = (real - torch.tensor(target, dtype=torch.float64)).abs()
            tag = "control" if control else "curve"
            row |= {f"{tag}_gen_flops_mean": float(real[:, 0].mean()), f"{tag}_gen_mem_mean": float(real[:, 1].mean()),
                    f"{tag}_max_abs_err_flops": float(err[:, 0].max()), f"{tag}_max_abs_err_mem": float(err[:, 1].max())}
            if control:
                row["decode_tokens_per_s"] = tps
        rows.append(row)
        print(json.dumps(row), flush=True)
    mixed = []
    if feasible:
        targets = [feasible[i % len(feasible)] for i in range(len(prompts))]
        engine, done, _ = serve(model, curve, prompts, targets, args.new_tokens)
        for r, t in zip(done, targets):
            f, m = engine.realised(r.rid)
            mixed.append({"request": r.rid, "target_flops": t[0], "target_mem": t[1], "realised_flops": f,
                          "realised_mem": m, "new_tokens": len(r.generated)})
    args.output.parent.mkdir(parents=True, exist_ok=True)
    _write_csv(args.output.with_suffix(".csv"), rows)
    _write_csv(args.output.with_name(args.output.name + "_mixed.csv"), mixed)
    args.output.with_suffix(".json").write_text(json.dumps(
        {"checkpoint": str(loaded.step_path), "curve": curve.to_dict(), "curve_seconds": curve_s, "budgets": rows,
         "mixed": mixed, "prompts": len(prompts), "new_tokens": args.new_tokens}, indent=1))
    _plot(args.output.with_suffix(".png"), [r for r in rows if r["feasible"]])
    for m in mixed:
        print(json.dumps(m))
    return 0


def _write_csv(path: Path, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)


def _plot(path: Path, rows: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["valid_realised_flops"] for r in rows], [r["valid_ppl"] for r in rows], "o-",
            label="one model, served at each budget")
    ax.set_xlabel("realised FLOPs fraction (held-out)")
    ax.set_ylabel("held-out perplexity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
