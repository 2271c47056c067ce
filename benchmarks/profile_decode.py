"""Where a TriRoute decode step's time goes, by op: `torch.profiler` over the decode steps of
`bench_decode.py`'s synthetic cell (random weights, the real controllers with the budget mix's
forced decisions, a cache filled at the mix's widths).

    OMP_NUM_THREADS=1 python benchmarks/profile_decode.py [--shape 160m] [--context 2048] [--batch 8] [--json]

Prints per op (by self CPU time, most first) its share of all ops' self time in the profiled steps
(Python between ops is not counted), its milliseconds per step and its calls per step; the decode ops of `triroute_kernels` appear under
their own names (`triroute::paged_attention`, `triroute::routed_experts`, ...). One process, one
system: shares, not a comparison with Dense (that is `bench_decode.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks import bench_decode  # noqa: E402
from benchmarks.forced_decisions import budget_mix  # noqa: E402
from megatron_triroute.systems import system_config  # noqa: E402


def op_shares(shape: str, context: int, batch: int, steps: int, warmup: int = 3) -> dict:
    """{"step_ms": the ops' self time a profiled step, "ops": [{name, share, ms_per_step, calls_per_step}]}."""
    from megatron_triroute.training.recipes import get_recipe

    config = system_config("triroute", get_recipe(shape).triroute.validate())
    model = bench_decode.build_routed(config)
    runner = bench_decode.RoutedRunner(model, context, batch, budget_mix(model.config, context), warmup + steps, 1)
    for _ in range(warmup):
        runner.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total_us = sum(e.self_cpu_time_total for e in events)
    ops = [{"name": e.key, "share": e.self_cpu_time_total / total_us, "ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            "calls_per_step": e.count / steps} for e in sorted(events, key=lambda e: -e.self_cpu_time_total)]
    return {"shape": shape, "context": context, "batch": batch, "steps": steps, "threads": torch.get_num_threads(),
            "step_ms": total_us / 1e3 / steps, "ops": ops}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="160m", help="recipe whose backbone is profiled (synthetic weights)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="profiled decode steps (after 3 unprofiled ones)")
    p.add_argument("--top", type=int, default=12, help="ops printed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    with torch.no_grad():
        result = op_shares(a.shape, a.context, a.batch, a.steps)
    if a.json:
        print(json.dumps(result | {"ops": result["ops"][: a.top]}, indent=1))
        return result
    print(f"{a.shape}, context {a.context}, batch {a.batch}, {result['threads']} thread(s): "
          f"{result['step_ms']:.1f} ms of ops a decode step (self CPU time, {a.steps} profiled steps)")
    print(f"{'op':<34} {'share':>6} {'ms/step':>8} {'calls/step':>10}")
    for op in result["ops"][: a.top]:
        print(f"{op['name']:<34} {op['share']:>6.1%} {op['ms_per_step']:>8.2f} {op['calls_per_step']:>10.1f}")
    return result


if __name__ == "__main__":
    main()
