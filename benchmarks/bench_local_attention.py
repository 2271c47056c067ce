"""The relaxed path's local mode (`model/mode_attention.local_attention`), forward and backward,
against its code at another git revision, interleaved in one process:

    OMP_NUM_THREADS=1 python benchmarks/bench_local_attention.py --baseline HEAD~1            # 160m shape
    OMP_NUM_THREADS=1 python benchmarks/bench_local_attention.py --baseline HEAD~1 --shape tiny

`--baseline REV` loads `megatron_triroute/model/mode_attention.py` as of git revision REV (or
`--baseline-file PATH`, a copy of it) as a second module; each round times `--iters` forward and
backward passes of this tree's `local_attention` and then the baseline's, on the same inputs (q, k
and v laid out as the layer passes them: (T, B) tensors transposed). Printed: the per-round ratios
(this tree / baseline; median, min, max), each side's median time, and the largest difference of
their outputs and gradients. Shapes: `160m` (one sequence of 2,048, 12 heads of 64, window 128)
and `tiny` (the tiny recipe's micro-batch of 8 x 128, 4 heads of 32 on one kv head, window 16).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_triroute.model import mode_attention  # noqa: E402

MODULE = "megatron_triroute/model/mode_attention.py"
SHAPES = {  # batch, sequence, query heads, kv heads, head dim, window
    "160m": (1, 2048, 12, 12, 64, 128),
    "tiny": (8, 128, 4, 1, 32, 16),
}


def load_baseline(source: str):
    """`mode_attention` from its source text (package-relative imports made absolute)."""
    source = source.replace("from ..", "from megatron_triroute.")
    with tempfile.TemporaryDirectory() as where:  # the file only while it is executed
        path = Path(where) / "baseline_mode_attention.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("baseline_mode_attention", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def baseline_source(rev: str | None, path: str | None) -> str:
    if path is not None:
        return Path(path).read_text()
    done = subprocess.run(["git", "show", f"{rev}:{MODULE}"], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"--baseline {rev}: git cannot show {MODULE} there ({done.stderr.strip()}); "
                         "pass a revision of this repository, or --baseline-file PATH")
    return done.stdout


def inputs(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, ...]:
    B, T, H, H_kv, d, _ = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, B, h, d, generator=g).transpose(0, 1) for h in (H, H_kv, H_kv))
    return q, k, v, torch.randn(B, T, H, d, generator=g)


def step(module, q, k, v, upstream, window: int) -> tuple[torch.Tensor, ...]:
    """Forward and backward of `module.local_attention`: (output, dq, dk, dv)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = module.local_attention(*leaves, window)
    grads = torch.autograd.grad((out * upstream).sum(), leaves)
    return (out.detach(), *grads)


def run(shape_name: str, source: str, rounds: int, iters: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    base = load_baseline(source)
    shape = SHAPES[shape_name]
    q, k, v, up = inputs(shape)
    window = shape[-1]
    ours, theirs = step(mode_attention, q, k, v, up, window), step(base, q, k, v, up, window)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    times = {"this_tree": [], "baseline": []}
    for _ in range(rounds):
        for name, module in (("this_tree", mode_attention), ("baseline", base)):
            start = time.perf_counter()
            for _ in range(iters):
                step(module, q, k, v, up, window)
            times[name].append((time.perf_counter() - start) / iters)
    ratios = [a / b for a, b in zip(times["this_tree"], times["baseline"])]
    return {"shape": shape_name, "rounds": rounds, "iters": iters, "threads": threads,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "this_tree_ms": 1e3 * statistics.median(times["this_tree"]),
            "baseline_ms": 1e3 * statistics.median(times["baseline"]), "max_abs_diff": diff}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--baseline", help="git revision whose mode_attention.py is the baseline")
    src.add_argument("--baseline-file", help="a copy of mode_attention.py to use as the baseline")
    p.add_argument("--shape", choices=sorted(SHAPES), default="160m")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--iters", type=int, default=None, help="passes per round (default: 1 at 160m, 10 at tiny)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.rounds < 1 or (a.iters is not None and a.iters < 1):
        p.error("--rounds and --iters take a positive count")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    iters = a.iters if a.iters is not None else (1 if a.shape == "160m" else 10)
    result = run(a.shape, baseline_source(a.baseline, a.baseline_file), a.rounds, iters, a.threads)
    result["baseline"] = a.baseline or a.baseline_file
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{a.shape}: this tree / baseline {result['baseline']}: median {result['ratio_median']:.3f} "
              f"[{result['ratio_min']:.3f}, {result['ratio_max']:.3f}] over {a.rounds} rounds; "
              f"{result['this_tree_ms']:.2f} ms against {result['baseline_ms']:.2f} ms a forward and backward; "
              f"largest difference {result['max_abs_diff']:.2e}")
    return result


if __name__ == "__main__":
    main()
