"""Wall time of one training step, TriRoute vs Dense on the same backbone (not run in CI).

    python benchmarks/bench_train_step.py [--recipe tiny] [key=value ...] [--micro-batch 8]
                                          [--warmup 2] [--repeats 7] [--json]
                                          [--device auto|cpu|cuda] [--bf16] [--peak-tflops 989]
                                          [--profile DIR] [--host-profile DIR] [--out FILE]

Both models are built in this process from one recipe: TriRoute as the recipe configures it,
Dense as `system_config("dense", <that config>)`, so they share the backbone (width, layers,
heads, sequence, vocabulary). They are at equal active FLOPs in the paper's sense: each expert is
`d_ff / top_k` wide, so a token routed to k real experts with `full` attention on every head
costs exactly a dense token (realised FLOPs fraction 1.0); the controller's decisions pull
TriRoute below that, and the realised fraction printed is the noise-free hard cost of the timed
steps, as the step report gives it.

A step is `TrainEngine.train_step` on one micro-batch, with the optimizer the trainer builds
(`training.trainer.build_optimizer`: Megatron-Core's DDP and distributed AdamW, and the LR
schedule): forward + backward (Megatron's schedule), gradient reduction, clipping, AdamW, router
statistics and budget update. After `--warmup` steps
of each model, the two models alternate step by step for `--repeats` steps each (so drift in the
machine's load hits both alike) and the median is reported. Training runs the relaxed path (every
head computes local and full attention, DeepSpeed dispatches with no drops), whose cost does not
shrink with the realised fraction: the ratio is the training-time overhead, not an inference
speed-up.

On a GPU (`--device cuda`, the default where CUDA is available) the models live on the device,
the process group is NCCL, each timed step ends with a device synchronise, and `--bf16` runs the
trainer's autocast. Model TFLOP/s counts `metrics.training_flops_per_token` at the dense cost
(the FLOPs both models are charged at equal active FLOPs), and MFU divides it by `--peak-tflops`.
`--profile DIR` records two extra steps of each model with `torch.profiler` and writes the top
operators by device time to `DIR/NAME_ops.txt`, and that time by the line of code that called each
operator (a backward operator: its autograd node) to `DIR/NAME_sources.txt`; `--host-profile DIR` runs two more steps of each
under cProfile and writes the Python functions that take the host's time to `DIR/NAME_host.txt`
(the whole profile, callers included, to `DIR/NAME_host.pstats`).

Alongside the times (median and interquartile range per model, and of the per-step ratio: the
models alternate who goes first), one extra untimed step of each model is counted: the aten ops it
dispatches (`aten_ops_ratio`), the bytes its memory-bound ops read and write (`moved_bytes_ratio`:
every op but the matmuls and attention kernels, views moving nothing; `op_counter.moved_bytes`, a
proxy for a GPU step's elementwise kernels' time), the host syncs among them (`host_syncs_per_step`: value reads such
as `.item()`, data-dependent shapes such as `nonzero` or a boolean-mask index, `bincount`, which
reads its input's maximum back on CUDA, device-to-host copies) and the attention
FLOPs it executes (`attention_flops_ratio`, from the shapes every SDPA call gets; see
`AttentionFlops`). 160m-shaped runs on a CPU, one sequence per step:

    python benchmarks/bench_train_step.py --recipe 160m triroute.model.n_layers=2 \
        triroute.model.vocab_size=4096 triroute.model.seq_len=2048 --micro-batch 1 --warmup 1 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from benchmarks.op_counter import StepCounter  # noqa: E402
from megatron_triroute.distributed.one_process import build_model, library_logs_to_stderr, single_process_parallel  # noqa: E402
from megatron_triroute.systems import system_config  # noqa: E402
from megatron_triroute.training.engine import MicroBatch, TrainEngine  # noqa: E402
from megatron_triroute.training.metrics import training_flops_per_token  # noqa: E402
from megatron_triroute.training.recipes import resolve  # noqa: E402
from megatron_triroute.training.trainer import build_optimizer  # noqa: E402


def _micro_batch(cfg, n: int, seed: int, device: torch.device) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (n, cfg.model.seq_len + 1), generator=g)
    return MicroBatch(tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device),
                      torch.ones(n, cfg.model.seq_len, device=device), torch.arange(n, device=device))


def _engine(cfg, groups, run, device: torch.device, bf16: bool):
    """The trainer's step over a model of `cfg`: its data-parallel engine (Megatron-Core's DDP and
    distributed optimizer, parallel/dp_engine.py) and LR schedule, as `training.trainer` builds them."""
    model = build_model(cfg, groups, seed=run.data.seed).to(device)
    optimizer, grad_sync, scheduler = build_optimizer(model, run, groups)
    return TrainEngine(model, groups, optimizer, total_steps=run.train.steps, clip_grad=run.optim.clip_grad,
                       scheduler=scheduler, bf16=bf16, grad_sync=grad_sync)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class AttentionFlops(TorchFunctionMode):
    """Forward FLOPs of the attention that executes, from the shapes every SDPA call gets:
    4 d per (query head, key) pair a kernel computes (QK^T and PV, 2 FLOPs a multiply-add), the
    pairs being the whole Tq x Tk rectangle under an explicit mask (a masked kernel computes
    every pair) and the Tq (Tq + 1) / 2 causal triangle under `is_causal` (the fast kernels skip
    the blocks above the diagonal). The backward pass repeats the same pairs, so the forward
    count gives the ratio of the whole."""

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            *batch, Tq, d = q.shape
            Tk = k.shape[-2]
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            pairs = Tq * (Tq + 1) // 2 if causal and Tq == Tk else Tq * Tk
            self.flops += 4 * d * pairs * int(torch.Size(batch).numel())
            self.calls += 1
        return func(*args, **kwargs)


def flex_flops(q: torch.Tensor, block_mask) -> int:
    """Forward FLOPs a FlexAttention call executes: 4 d per (query head, key) pair of every block
    its mask leaves in (partial blocks are computed whole and masked inside), q (B, H, T, d)."""
    B, H, _, d = q.shape
    q_block, kv_block = block_mask.BLOCK_SIZE
    blocks = int(block_mask.kv_num_blocks.sum()) + int(block_mask.full_kv_num_blocks.sum())
    per_mask = B * H // (block_mask.kv_num_blocks.shape[0] * block_mask.kv_num_blocks.shape[1])
    return 4 * d * blocks * q_block * kv_block * per_mask


def counted_flex(flex, counter: StepCounter, flops: "AttentionFlops"):
    """`flex` (`mode_attention.flex_local_attention`) with its FLOPs counted from its block mask and
    the call counted as one foreign op of `counter`. torch.compile does not run under a dispatch
    mode, so the call runs with the counters' modes set aside."""
    from torch.utils._python_dispatch import _disable_current_modes

    from megatron_triroute.model import mode_attention

    def run(q, k, v, window):
        flops.flops += flex_flops(q.transpose(1, 2), mode_attention._flex_window_mask(q.shape[1], window, q.device))
        flops.calls += 1
        counter.ops += 1
        counter.foreign_ops["flex_attention"] = counter.foreign_ops.get("flex_attention", 0) + 1
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            return flex(q, k, v, window)
    return run


def _count_step(engine, mb, step: int, device: torch.device) -> dict:
    """One training step under the op, sync and attention-FLOP counters (not timed); on CUDA one
    more step under CUDA's own synchronisation check (`cuda_syncs`). The local mode's FlexAttention
    calls reach no SDPA, so their FLOPs are counted from the block masks they run with."""
    from megatron_triroute.model import mode_attention

    counter, flops = StepCounter(), AttentionFlops()
    flex = mode_attention.flex_local_attention
    mode_attention.flex_local_attention = counted_flex(flex, counter, flops)
    try:
        with flops, counter:
            report = engine.train_step([mb], step)
    finally:
        mode_attention.flex_local_attention = flex
    if report.skipped:
        raise RuntimeError(f"counted step {step} was skipped (non-finite loss or gradients)")
    counts = {"aten_ops": counter.ops, "moved_bytes": counter.moved_bytes,
              "host_syncs": sum(counter.syncs.values()), "host_sync_ops": counter.syncs,
              "attention_flops": flops.flops, "sdpa_calls": flops.calls, "gpu_slow_ops": counter.gpu_slow_ops}
    if device.type == "cuda":
        counts["cuda_syncs"], counts["cuda_sync_sites"] = _cuda_syncs(engine, mb, step + 1)
    return counts


def _cuda_syncs(engine, mb, step: int) -> tuple[int, dict[str, int]]:
    """Every call that synchronises the host with the device in one step, as CUDA reports it
    (`torch.cuda.set_sync_debug_mode`): the ground truth the op counter's `host_syncs` approximates
    from op names (it cannot see a sync inside an op, such as a blocking host-to-device copy).
    Returns the count and the Python lines that made them, most frequent first."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.train_step([mb], step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            site = f"{w.filename}:{w.lineno}"
            sites[site] = sites.get(site, 0) + 1
    return sum(sites.values()), dict(sorted(sites.items(), key=lambda kv: -kv[1]))


def _spread(values: list[float]) -> dict:
    """Median and interquartile range (inclusive quartiles; both ends for fewer than 4 values)."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values * 3)
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "iqr": q3 - q1}


def _profile(engines: dict, data: list, device: torch.device, out: Path) -> None:
    """Two steps of each model under torch.profiler; the top 80 operators and kernels by their own
    (device or CPU) time, names up to 120 characters (a kernel's template arguments tell apart the
    elementwise kernels), to DIR/NAME_ops.txt; the same time by where in the code each operator was
    called (`by_source`) to DIR/NAME_sources.txt."""
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name, engine in engines.items():
        with profile(activities=activities, with_stack=True) as prof:
            for step, mb in enumerate(data[:2]):
                engine.train_step([mb], 10_000 + step)
            _sync(device)
        table = prof.key_averages().table(sort_by=sort, row_limit=80, max_name_column_width=120)
        (out / f"{name}_ops.txt").write_text(table)
        (out / f"{name}_sources.txt").write_text(format_sources(by_source(prof.events(), device.type == "cuda")))
        print(f"profile of {name}: {out / f'{name}_ops.txt'}, {out / f'{name}_sources.txt'}")


SOURCE_ROOTS = ("megatron_triroute/", "triroute_kernels/", "kernels/", "megatron/core/", "deepspeed/")
"""Code whose lines an operator's time is charged to: this project's, then the libraries it adapts."""


def by_source(events, device_time: bool) -> dict:
    """{(where, operator): [self time in ms, calls]} over a profile's operator events (recorded
    `with_stack`, so Python frames enclose them): the operator's own device time (its kernels; CPU
    time without `device_time`), charged to the innermost enclosing frame under `SOURCE_ROOTS`, or to
    the autograd node a backward operator ran in ("backward NAME"), whichever encloses it first."""
    table: dict = {}
    for ev in events:
        if ev.device_type.name != "CPU" or ".py(" in ev.name or ev.name.startswith(("<built-in", "autograd::")):
            continue  # Python frames (the stack itself) and autograd's bookkeeping
        spent = (ev.self_device_time_total if device_time else ev.self_cpu_time_total) / 1e3
        if spent <= 0:
            continue
        where, parent = None, ev.cpu_parent  # the innermost enclosing frame of our code, or autograd node
        while where is None and parent is not None:
            if parent.name.startswith("autograd::engine::evaluate_function: "):
                where = "backward " + parent.name.split(": ", 1)[1]
            elif ".py(" in parent.name and any(r in parent.name for r in SOURCE_ROOTS):
                where = parent.name
            parent = parent.cpu_parent
        row = table.setdefault((where or "other", ev.name), [0.0, 0])
        row[0] += spent
        row[1] += 1
    return table


def format_sources(table: dict, rows: int = 80) -> str:
    """`by_source`'s largest rows: ms, calls, operator, where (paths from the package roots)."""
    total = sum(ms for ms, _ in table.values())
    lines = [f"{total:.1f} ms in all; the largest {min(rows, len(table))} of {len(table)} (where, operator):"]
    for (where, op), (ms, calls) in sorted(table.items(), key=lambda kv: -kv[1][0])[:rows]:
        short = next((where[where.index(r):] for r in SOURCE_ROOTS if r in where), where)
        lines.append(f"{ms:10.2f} ms {calls:7d}  {op:<36} {short}")
    return "\n".join(lines) + "\n"


def _host_profile(engines: dict, data: list, device: torch.device, out: Path) -> dict:
    """Two steps of each model under cProfile: where the host's time goes (on a GPU the step is
    bound by it), by Python function. Writes DIR/NAME_host.txt (top 40 by own time, then by
    cumulative time) and the whole profile as DIR/NAME_host.pstats; returns each model's profiled
    host seconds per step."""
    import cProfile
    import io
    import pstats

    out.mkdir(parents=True, exist_ok=True)
    per_step = {}
    for name, engine in engines.items():
        prof = cProfile.Profile()
        _sync(device)
        prof.enable()
        for step, mb in enumerate(data[:2]):
            engine.train_step([mb], 20_000 + step)
        _sync(device)
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        per_step[name] = stats.total_tt / 2
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(40)
        (out / f"{name}_host.txt").write_text(text.getvalue())
        stats.dump_stats(out / f"{name}_host.pstats")  # the whole profile, callers included (pstats, snakeviz)
        print(f"host profile of {name}: {out / f'{name}_host.txt'}")
    return per_step


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda where available, else cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 parameters, as the trainer")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the device's dense bf16 peak for MFU (H100 SXM: 989)")
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    parser.add_argument("--profile", type=Path, default=None, help="write top-operator tables here")
    parser.add_argument("--host-profile", type=Path, default=None,
                        help="write cProfile tables of two steps of each model here (where the host's time goes)")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    device = torch.device(args.device)

    run = resolve(args.recipe, args.overrides)
    configs = {run.system: run.triroute.validate(), "dense": system_config("dense", run.triroute)}
    times: dict[str, list[float]] = {name: [] for name in configs}
    cpu_times: dict[str, list[float]] = {name: [] for name in configs}
    realised: list[float] = []
    backend = "nccl" if device.type == "cuda" else "gloo"
    # on a CPU-only machine this applies the CPU workarounds; where CUDA is available it applies none
    with library_logs_to_stderr(), single_process_parallel(backend) as groups:
        engines = {name: _engine(cfg, groups, run, device, args.bf16) for name, cfg in configs.items()}
        data = [_micro_batch(configs["dense"], args.micro_batch, seed, device)
                for seed in range(args.warmup + args.repeats)]
        order = list(engines)
        for step, mb in enumerate(data):
            for name in (order if step % 2 == 0 else order[::-1]):  # alternate who goes first
                engine = engines[name]
                _sync(device)
                start, start_cpu = time.perf_counter(), time.process_time()
                report = engine.train_step([mb], step)
                _sync(device)
                elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
                if report.skipped:
                    raise RuntimeError(f"{name}: step {step} was skipped (non-finite loss or gradients)")
                if step >= args.warmup:
                    times[name].append(elapsed)
                    cpu_times[name].append(elapsed_cpu)
                    if name == run.system:
                        realised.append(report.realised[0])
        if device.type == "cuda":
            peak_memory = torch.cuda.max_memory_allocated(device) / 2**30
        counts = {name: _count_step(engine, data[0], len(data), device) for name, engine in engines.items()}
        if args.profile is not None:
            _profile(engines, data, device, args.profile)
        host = _host_profile(engines, data, device, args.host_profile) if args.host_profile is not None else None
    system = run.system
    m = configs[system].model
    tokens = args.micro_batch * m.seq_len
    median = {name: statistics.median(t) for name, t in times.items()}
    median_cpu = {name: statistics.median(t) for name, t in cpu_times.items()}
    model_flops = training_flops_per_token(configs["dense"], 1.0) * tokens  # dense cost, both models
    tflops = {n: model_flops / s / 1e12 for n, s in median.items()}
    result = {
        "recipe": run.name, "system": system, "micro_batch": args.micro_batch, "seq_len": m.seq_len,
        "d_model": m.d_model, "n_layers": m.n_layers, "warmup": args.warmup, "repeats": args.repeats,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "bf16": args.bf16,
        "peak_memory_gib": peak_memory if device.type == "cuda" else None,
        "model_tflops": tflops, "mfu": {n: v / args.peak_tflops for n, v in tflops.items()},
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "median_s": median, "tokens_per_s": {n: tokens / s for n, s in median.items()},
        "median_cpu_s": median_cpu,
        "ratio": median[system] / median["dense"], "cpu_ratio": median_cpu[system] / median_cpu["dense"],
        "realised_flops_fraction": statistics.mean(realised),
        "step_s": {name: _spread(t) for name, t in times.items()},
        "ratio_per_step": _spread([a / b for a, b in zip(times[system], times["dense"])]),
        "cpu_ratio_per_step": _spread([a / b for a, b in zip(cpu_times[system], cpu_times["dense"])]),
        "counts": counts,
        "host_profile_s_per_step": host,
        "aten_ops_ratio": counts[system]["aten_ops"] / counts["dense"]["aten_ops"],
        "moved_bytes_ratio": counts[system]["moved_bytes"] / counts["dense"]["moved_bytes"],
        "host_syncs_per_step": {name: c["host_syncs"] for name, c in counts.items()},
        "cuda_syncs_per_step": ({name: c["cuda_syncs"] for name, c in counts.items()} if device.type == "cuda" else None),
        "attention_flops_ratio": counts[system]["attention_flops"] / counts["dense"]["attention_flops"],
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"recipe {run.name}: d={m.d_model}, {m.n_layers} layers, seq {m.seq_len}, micro-batch "
              f"{args.micro_batch}; {args.repeats} timed steps each after {args.warmup} warm-up, "
              f"{result['device']}{', bf16' if args.bf16 else ''}, {result['threads']} threads, "
              f"load average {result['load_average']}")
        for name in configs:
            spread = result["step_s"][name]
            print(f"  {name:<10} median {1e3 * median[name]:9.1f} ms/step (IQR {1e3 * spread['iqr']:.1f})  "
                  f"{result['tokens_per_s'][name]:10.0f} tokens/s"
                  f"  {tflops[name]:7.1f} model TFLOP/s (MFU {tflops[name] / args.peak_tflops:.1%})"
                  f"  (process CPU time {1e3 * median_cpu[name]:9.1f} ms/step)")
        print(f"  ratio {system}/dense: {result['ratio']:.2f} wall, {result['cpu_ratio']:.2f} CPU time;   "
              f"realised FLOPs fraction of {system}: {result['realised_flops_fraction']:.3f}")
        r = result["ratio_per_step"]
        c = result["cpu_ratio_per_step"]
        print(f"  per-step ratio {system}/dense: median {r['median']:.2f}, IQR {r['q1']:.2f}..{r['q3']:.2f} wall; "
              f"median {c['median']:.2f}, IQR {c['q1']:.2f}..{c['q3']:.2f} process CPU time")
        print(f"  per step, {system}/dense: aten ops {counts[system]['aten_ops']}/{counts['dense']['aten_ops']} "
              f"= {result['aten_ops_ratio']:.2f}; bytes moved by memory-bound ops "
              f"{counts[system]['moved_bytes'] / 1e6:.1f}/{counts['dense']['moved_bytes'] / 1e6:.1f} MB "
              f"= {result['moved_bytes_ratio']:.2f}; attention FLOPs (forward, as executed) "
              f"{result['attention_flops_ratio']:.3f}; host syncs {counts[system]['host_syncs']} vs "
              f"{counts['dense']['host_syncs']} ({counts[system]['host_sync_ops']})")
        for name in configs:
            if counts[name]["gpu_slow_ops"]:
                print(f"  WARNING: {name} dispatches ops known to be slow on a GPU: {counts[name]['gpu_slow_ops']}")
        if device.type == "cuda":
            top = list(counts[system]["cuda_sync_sites"].items())[:8]
            print(f"  synchronising calls per step as CUDA reports them: {system} {counts[system]['cuda_syncs']}, "
                  f"dense {counts['dense']['cuda_syncs']}; {system}'s most frequent sites: {top}")
    return result


if __name__ == "__main__":
    main()
