"""Where a training step's aten ops come from, TriRoute against Dense (not run in CI).

    python benchmarks/op_sources.py [--recipe tiny] [key=value ...] [--micro-batch 8] [--bf16]
                                    [--top 30] [--json]

Builds both models as `bench_train_step.py` does (the trainer's optimizer, one process), runs two
warm-up steps of each, then counts one step of each: every top-level aten op dispatched (as
`op_counter.StepCounter` counts them) is attributed to its phase and source:

- backward: the autograd node that runs it (`torch._C._current_autograd_node`), e.g. `MulBackward0`;
- forward and the rest of the step: the innermost Python function of this package, Megatron-Core or
  DeepSpeed on the call stack (`file:function`); forward = inside the model's forward.

It prints the ops per source group (the controller, the noise, the losses, the cost model, the
statistics, attention, experts, the optimizer, the step-end commits, backward) and the top
sources by count, for both models; then the same groups by the bytes their ops read and write
(each op's tensor arguments and results; views move none), and the top (source, op) pairs by bytes:
on a GPU, where an elementwise op's time is its bytes over the bandwidth, that ranks the device
time the ops cost, independent of the device it is measured on.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.module_tracker import ModuleTracker  # noqa: E402

_PACKAGES = ("megatron_triroute/", "megatron/core/", "deepspeed/")

GROUPS = (  # (substring of the source, group), first match wins; forward sources only
    ("noise.py", "forward: counter-based noise"), ("losses.py", "forward: balancing losses"),
    ("cost.py", "forward: cost model and budget"), ("modes.py", "forward: cost model and budget"),
    ("budget.py", "forward: cost model and budget"), ("layer.py:_record", "forward: router statistics"),
    ("quant.py", "forward: relaxed K/V write"), ("attention.py", "forward: attention"),
    ("rope_utils", "forward: attention"), ("swiglu.py", "forward: experts / FFN"),
    ("deepspeed", "forward: experts / FFN"), ("experts/", "forward: experts / FFN"),
    ("routing/", "forward: controller"),
)


VIEW_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.permute", "aten.expand", "aten.select",
    "aten.slice", "aten.unsqueeze", "aten.squeeze", "aten.as_strided", "aten.detach", "aten.alias", "aten.unbind",
    "aten.split", "aten.split_with_sizes", "aten.chunk", "aten.narrow", "aten._reshape_alias", "aten.lift_fresh",
})
"""Ops that return views: they move no bytes (a `reshape` that copies reaches the dispatcher as a copy)."""


def _tensor_bytes(values) -> int:
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, (list, tuple)):
            total += _tensor_bytes(v)
    return total


class SourceCounter(TorchDispatchMode):
    """Counts aten ops per (phase, source, op), and the bytes they read and write: each op's tensor
    arguments and results at their sizes (views excluded). On a GPU an elementwise op's time is its
    bytes over the memory bandwidth, so bytes per source rank where the device's time goes, op
    launches aside."""

    def __init__(self, tracker: ModuleTracker):
        super().__init__()
        self.tracker = tracker
        self.counts: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            phase, source = "backward", node.name() if node is not None else "?"
        else:
            phase = "forward" if any(p != "Global" for p in self.tracker.parents) else "step"
            source = _python_source(sys._getframe(1))
        key = (phase, source, str(func.overloadpacket))
        self.counts[key] += 1
        out = func(*args, **(kwargs or {}))
        if key[2] not in VIEW_OPS:
            self.bytes[key] += _tensor_bytes(args) + _tensor_bytes((kwargs or {}).values()) + _tensor_bytes((out,))
        return out


def _python_source(frame) -> str:
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        for package in _PACKAGES:
            if package in name and "python_dispatch" not in name:
                return package + name.split(package, 1)[1] + ":" + frame.f_code.co_name
        frame = frame.f_back
    return "?"


def group(phase: str, source: str) -> str:
    if phase == "backward":
        return "backward (autograd nodes)"
    if phase == "step":
        if "optimizer" in source or "grad_reduce" in source or "megatron_distopt" in source:
            return "step: optimizer, gradient norm and clip"
        return "step: running-statistics commits, budget, statistics"
    return next((g for key, g in GROUPS if key in source), "forward: rest (norms, embedding, LM head, schedule)")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as the trainer")
    parser.add_argument("--top", type=int, default=30, help="sources listed per model")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from benchmarks.bench_train_step import _engine, _micro_batch
    from megatron_triroute.distributed.one_process import library_logs_to_stderr, single_process_parallel
    from megatron_triroute.systems import system_config
    from megatron_triroute.training.recipes import resolve

    run = resolve(args.recipe, args.overrides)
    configs = {run.system: run.triroute.validate(), "dense": system_config("dense", run.triroute)}
    device = torch.device("cpu")
    counts = {}
    with library_logs_to_stderr(), single_process_parallel("gloo") as groups:
        engines = {name: _engine(cfg, groups, run, device, args.bf16) for name, cfg in configs.items()}
        data = [_micro_batch(configs["dense"], args.micro_batch, seed, device) for seed in range(3)]
        for step in range(2):
            for engine in engines.values():
                engine.train_step([data[step]], step)
        for name, engine in engines.items():
            tracker = ModuleTracker()
            counter = SourceCounter(tracker)
            with tracker, counter:
                engine.train_step([data[2]], 2)
            counts[name] = (counter.counts, counter.bytes)
    result = {}
    for name, (c, b) in counts.items():
        groups_, sources, group_bytes, source_bytes = (collections.Counter() for _ in range(4))
        for (phase, source, _), n in c.items():
            groups_[group(phase, source)] += n
            sources[f"{phase} {source}"] += n
        for (phase, source, op), n in b.items():
            group_bytes[group(phase, source)] += n
            source_bytes[f"{phase} {source} {op}"] += n
        result[name] = {"ops": sum(c.values()), "groups": dict(groups_.most_common()),
                        "sources": dict(sources.most_common(args.top)),
                        "bytes": sum(b.values()), "group_bytes": dict(group_bytes.most_common()),
                        "source_op_bytes": dict(source_bytes.most_common(args.top))}
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    system = run.system
    mb = 2**20
    _print_tables(result, system, f"aten ops per step, recipe {run.name}, micro-batch {args.micro_batch}"
                  f"{', bf16' if args.bf16 else ''}", "groups", "ops", "sources", lambda n: f"{n:,}")
    _print_tables(result, system, "\nMiB read and written per step (tensor arguments and results, views excluded)",
                  "group_bytes", "bytes", "source_op_bytes", lambda n: f"{n / mb:,.1f}")
    return result


def _print_tables(result: dict, system: str, title: str, groups: str, total: str, sources: str, fmt) -> None:
    """One measure (ops or bytes): the per-group table of both models, then each model's top sources."""
    print(title)
    print(f"| group | {system} | dense |\n|---|---|---|")
    for g in result[system][groups]:
        print(f"| {g} | {fmt(result[system][groups][g])} | {fmt(result['dense'][groups].get(g, 0))} |")
    print(f"| total | {fmt(result[system][total])} | {fmt(result['dense'][total])} |")
    for name in result:
        print(f"\ntop {sources.replace('_', ' ')}, {name}:")
        for source, n in result[name][sources].items():
            print(f"  {fmt(n):>10}  {source}")


if __name__ == "__main__":
    main()
