"""Where a TriRoute decode step's time goes, by op: `torch.profiler` over the decode steps of
`bench_decode.py`'s synthetic cell (random weights, the real controllers with the budget mix's
forced decisions, a cache filled at the mix's widths).

    OMP_NUM_THREADS=1 python benchmarks/profile_decode.py [--shape 160m] [--context 2048] [--batch 8] [--json]

Prints per op (by self CPU time, most first) its share of all ops' self time in the profiled steps
(Python between ops is not counted), its milliseconds per step and its calls per step; the decode ops of `triroute_kernels` appear under
their own names (`triroute::paged_attention`, `triroute::routed_experts`, ...). One process, one
system: shares, not a comparison with Dense (that is `bench_decode.py`).

    OMP_NUM_THREADS=1 python benchmarks/profile_decode.py --baseline REV [--rounds 20]
    OMP_NUM_THREADS=1 python benchmarks/profile_decode.py --against-op-by-op [--rounds 20]

`--baseline REV` times whole decode steps instead: the ops of `kernels/csrc/decode_ops.cpp` as of git
revision REV (built as `bench_cpu_ops.py --baseline` builds them, library `triroute_baseline`) stand
in for this tree's (`torch.ops.triroute.paged_attention`, `routed_experts`, `decode_linear`,
`cache_append`, ...) on every other step of one runner, A B then B A (`bench_cpu_ops.interleaved`);
everything else in the step is this tree's, and the layers run op by op on both sides (the one-call
step and layer, `triroute.decode_layers` and `decode_layer`, call this tree's kernels whatever op
stands in for them). Prints the median step time of each and the median and
quartiles of the per-round ratio this tree / baseline: a kernel change measured in the step it serves
(cold caches, the experts' weights streaming beside it), in one process, so both see the same machine
load. The baseline's ops must take this tree's arguments (an op whose schema differs is refused) and
keep its cache layout (not checked here: `bench_cpu_ops.py --baseline` compares the attention's
outputs).

`--against-op-by-op` times whole decode steps of one runner with its layers in one call
(`triroute.decode_layers`, the default: every layer's decisions and ops, `inference/fused_step.py`)
and the same layers op by op (`InferenceModel.fused_step` and `InferenceLayer.fused` off) on
alternate steps, A B then B A; prints the median step of each and the quartiles of the per-round
ratio one call / op by op. `--against-layer-calls` does the same against each layer's ops after its
decisions in one call (`triroute.decode_layer`), the controller called from Python.

    OMP_NUM_THREADS=1 python benchmarks/profile_decode.py --against-base-pages [--rounds 20]

`--against-base-pages` times whole decode steps of two runners alike but for where their weights
live: on huge pages (`inference/huge_pages.py`, what the engine's checkpoint loader does) and where
PyTorch allocated them, on alternate steps, A B then B A; prints the median step of each and the
quartiles of the per-round ratio huge / base pages.

    OMP_NUM_THREADS=1 python benchmarks/profile_decode.py --against-no-audit [--rounds 20]

`--against-no-audit` times whole decode steps of one runner (the scheduler's preparation, the step
and its finish) with the engine's cost audit on and off on alternate steps, A B then B A: what
`generate` and serving pay for it, since the engine audits every step (its per-request budget
control reads each step's costs) and `bench_decode.py` times its steps without it. Prints the median
step of each and the quartiles of the per-round ratio audited / not.
"""

from __future__ import annotations

import argparse
import contextlib
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


def synthetic_runner(shape: str, context: int, batch: int, steps: int, huge_pages: bool = True) -> bench_decode.RoutedRunner:
    """`bench_decode.py`'s synthetic TriRoute cell for `steps` decode steps: the recipe's backbone with
    random weights (on huge pages unless `huge_pages` is False), its controllers forced to the budget
    mix, a cache of `context` tokens."""
    from megatron_triroute.training.recipes import get_recipe

    config = system_config("triroute", get_recipe(shape).triroute.validate())
    model = bench_decode.build_routed(config, huge_pages=huge_pages)
    return bench_decode.RoutedRunner(model, context, batch, budget_mix(model.config, context), steps, 1)


def op_shares(shape: str, context: int, batch: int, steps: int, warmup: int = 3) -> dict:
    """{"step_ms": the ops' self time a profiled step, "ops": [{name, share, ms_per_step, calls_per_step}]}."""
    runner = synthetic_runner(shape, context, batch, warmup + steps)
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


class OpSwap:
    """A context in which each op of `torch.ops.<namespace>` answers for the `torch.ops.triroute` op
    of its name (the package's wrappers look the op up at every call); on exit the package's ops again.
    The names are found once, here: entering and leaving sets a handful of attributes."""

    def __init__(self, namespace: str):
        prefix = f"{namespace}::"
        self.names = sorted({n[len(prefix):].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                             if n.startswith(prefix)})
        if not self.names:
            raise ValueError(f"no ops are registered under torch.ops.{namespace}")
        self.ours = {n: getattr(torch.ops.triroute, n) for n in self.names}
        self.theirs = {n: getattr(getattr(torch.ops, namespace), n) for n in self.names}
        for n in self.names:  # a stand-in must take the package's arguments
            ours, theirs = (str(op.default._schema).split("::", 1)[1] for op in (self.ours[n], self.theirs[n]))
            if ours != theirs:
                raise ValueError(f"torch.ops.{namespace}.{n} takes `{theirs}` but the package calls `{ours}`: "
                                 "compare against a revision whose decode ops have this tree's schemas")

    def __enter__(self) -> "OpSwap":
        for n, op in self.theirs.items():
            setattr(torch.ops.triroute, n, op)
        return self

    def __exit__(self, *exc) -> None:
        for n, op in self.ours.items():
            setattr(torch.ops.triroute, n, op)


class Fused:
    """A context in which the model's decode steps run their layers in one call (`mode` "step",
    `InferenceModel.fused_step`, the default), each layer in one call ("layer", `InferenceLayer.fused`)
    or op by op ("op by op"); on exit as before."""

    MODES = ("step", "layer", "op by op")

    def __init__(self, model, mode: str):
        if mode not in self.MODES:
            raise ValueError(f"mode {mode!r}: one of {self.MODES}")
        self.model, self.layers, self.mode = model, list(model.layers), mode

    def __enter__(self) -> None:
        self.before = (self.model.fused_step, [layer.fused for layer in self.layers])
        self.model.fused_step = self.mode == "step"
        for layer in self.layers:
            layer.fused = self.mode != "op by op"

    def __exit__(self, *exc) -> None:
        self.model.fused_step = self.before[0]
        for layer, was in zip(self.layers, self.before[1]):
            layer.fused = was


def alternating(ours, theirs, rounds: int, warmup: int = 3) -> tuple[float, float, tuple]:
    """`ours()` and `theirs()` (a decode step each), `warmup` of each first, then on alternate steps
    (A B, B A, ...): the median step of each and the quartiles of the per-round ratio ours / theirs."""
    from benchmarks.bench_cpu_ops import interleaved

    for _ in range(warmup):
        ours()
        theirs()
    return interleaved(lambda _counters: ours(), lambda _counters: theirs(), rounds)


def interleaved_steps(runner, ours, theirs, rounds: int, warmup: int = 3) -> tuple[float, float, tuple]:
    """`alternating` decode steps of one runner inside the contexts `ours()` and `theirs()`."""
    def step(context):
        with context():
            runner.step()

    return alternating(lambda: step(ours), lambda: step(theirs), rounds, warmup)


def _result(shape, context, batch, rounds, timed) -> dict:
    ours_s, theirs_s, (q1, median, q3) = timed
    return {"shape": shape, "context": context, "batch": batch, "rounds": rounds, "threads": torch.get_num_threads(),
            "this_tree_ms": 1e3 * ours_s, "baseline_ms": 1e3 * theirs_s,
            "ratio_median": median, "ratio_q1": q1, "ratio_q3": q3}


def step_against(namespace: str, shape: str, context: int, batch: int, rounds: int, warmup: int = 3) -> dict:
    """Decode steps of one runner, this tree's ops and `namespace`'s on alternate steps (A B, B A, ...):
    the median step of each and the quartiles of the per-round ratio this tree / theirs. The layers
    run op by op on both (`InferenceLayer.fused` off): the one-call layer runs this tree's kernels
    whatever op stands in for them."""
    runner = synthetic_runner(shape, context, batch, 2 * (warmup + rounds))
    unfused = Fused(runner.model, "op by op")
    swap, same = OpSwap(namespace), OpSwap("triroute")  # both steps set the same attributes

    @contextlib.contextmanager
    def both(ops):
        with unfused, ops:
            yield

    return _result(shape, context, batch, rounds,
                   interleaved_steps(runner, lambda: both(same), lambda: both(swap), rounds, warmup))


def fused_against(shape: str, context: int, batch: int, rounds: int, warmup: int = 3, theirs: str = "op by op") -> dict:
    """Decode steps of one runner with the step's layers in one call (`triroute.decode_layers`, the
    default) and as `theirs` (`Fused`: each layer in one call, or op by op) on alternate steps (A B,
    B A, ...): the median step of each and the per-round ratio one call / theirs."""
    runner = synthetic_runner(shape, context, batch, 2 * (warmup + rounds))
    return _result(shape, context, batch, rounds, interleaved_steps(
        runner, lambda: Fused(runner.model, "step"), lambda: Fused(runner.model, theirs), rounds, warmup))


def huge_against_base_pages(shape: str, context: int, batch: int, rounds: int, warmup: int = 3) -> dict:
    """Whole decode steps of two runners alike but for where their weights live, on huge pages
    (`inference/huge_pages.py`, the default) and where PyTorch allocated them, on alternate steps
    (A B, B A, ...): the median step of each and the per-round ratio huge / base pages. Both are in
    memory at once (twice the weights)."""
    from megatron_triroute.inference.huge_pages import huge_pages_available

    if not huge_pages_available():
        raise SystemExit("this kernel offers no transparent huge pages (not Linux, or "
                         "/sys/kernel/mm/transparent_hugepage/enabled is never): nothing to compare")
    huge, base = (synthetic_runner(shape, context, batch, warmup + rounds, huge_pages=h) for h in (True, False))
    return _result(shape, context, batch, rounds, alternating(huge.step, base.step, rounds, warmup))


def audit_against_none(shape: str, context: int, batch: int, rounds: int, warmup: int = 3) -> dict:
    """Whole decode steps of one runner with the cost audit (`InferenceModel.finish` counting the
    step) and without it on alternate steps (A B, B A, ...): the median step of each and the per-round
    ratio audited / not."""
    from megatron_triroute.inference.audit import CostAudit

    runner = synthetic_runner(shape, context, batch, 2 * (warmup + rounds))
    audit = CostAudit(runner.model.config.model.n_layers)
    return _result(shape, context, batch, rounds, alternating(lambda: runner.step(audit), runner.step, rounds, warmup))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="160m", help="recipe whose backbone is profiled (synthetic weights)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="profiled decode steps (after 3 unprofiled ones)")
    p.add_argument("--top", type=int, default=12, help="ops printed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--baseline", metavar="REV", help="time whole steps against the decode ops of git revision REV, "
                                                     "interleaved (module doc)")
    p.add_argument("--against-op-by-op", action="store_true",
                   help="time whole steps with the layers in one call against the same layers op by op, interleaved")
    p.add_argument("--against-layer-calls", action="store_true",
                   help="time whole steps with the layers in one call against one call per layer, interleaved")
    p.add_argument("--against-base-pages", action="store_true",
                   help="time whole steps with the weights on huge pages against the same model's weights on the "
                        "pages PyTorch allocated, interleaved (two models in memory)")
    p.add_argument("--against-no-audit", action="store_true",
                   help="time whole steps with the engine's cost audit against the same steps without it, interleaved")
    p.add_argument("--rounds", type=int, default=20,
                   help="--baseline and the --against comparisons: A B rounds timed (after 3 of each untimed)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: give at least 1")
    comparisons = (a.baseline, a.against_op_by_op, a.against_layer_calls, a.against_base_pages, a.against_no_audit)
    if sum(map(bool, comparisons)) > 1:
        p.error("--baseline, --against-op-by-op, --against-layer-calls, --against-base-pages and --against-no-audit "
                "are five comparisons: give one")
    if any(comparisons):
        with torch.no_grad():
            if a.baseline:
                from benchmarks.bench_cpu_ops import baseline_ops

                baseline_ops(a.baseline)
                result = step_against("triroute_baseline", a.shape, a.context, a.batch, a.rounds) | {"baseline": a.baseline}
                ours, theirs, ratio = "this tree", f"{a.baseline}'s decode ops", "this tree / baseline"
            elif a.against_no_audit:
                result = audit_against_none(a.shape, a.context, a.batch, a.rounds)
                ours, theirs, ratio = "with the cost audit", "without", "audited / not"
            elif a.against_base_pages:
                result = huge_against_base_pages(a.shape, a.context, a.batch, a.rounds)
                ours, theirs, ratio = "weights on huge pages", "on the pages PyTorch allocated", "huge / base pages"
            elif a.against_layer_calls:
                result = fused_against(a.shape, a.context, a.batch, a.rounds, theirs="layer")
                ours, theirs, ratio = "the layers in one call", "one call per layer", "one call / per layer"
            else:
                result = fused_against(a.shape, a.context, a.batch, a.rounds)
                ours, theirs, ratio = "the layers in one call", "op by op", "one call / op by op"
        if a.json:
            print(json.dumps(result, indent=1))
            return result
        print(f"{a.shape}, context {a.context}, batch {a.batch}, {result['threads']} thread(s), {a.rounds} rounds: "
              f"decode step {result['this_tree_ms']:.1f} ms ({ours}) against {result['baseline_ms']:.1f} ms "
              f"({theirs}); {ratio} per round: median {result['ratio_median']:.3f} "
              f"[{result['ratio_q1']:.3f}-{result['ratio_q3']:.3f}]")
        return result
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
