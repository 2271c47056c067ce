"""The data-parallel engine's overlap: step time, communication hidden behind compute, peak memory
of the run's engine (Megatron-Core's distributed optimizer, parallel/dp_engine.py) with its
default overlap (gradient reduce-scatter during the backward, parameter all-gather during the next
forward) against the same engine with both collectives after the backward (`no_overlap`, the
baseline). With `--bf16`, also under the bf16 forward (autocast, several times slower than fp32 on
a CPU, so measured against its own baseline): the default engine (`default_bf16_forward`) and
bf16 gradients (`bf16_gradients`, `parallel.grad_reduce_dtype=bf16`: bf16 matrices, buckets and
all-gathers, fp32 master shards).

    python benchmarks/bench_dp_overlap.py [--recipe tiny] [key=value ...] [--nprocs 2 4] [--bf16]
                                          [--micro-batch 4] [--micro-batches 2] [--bucket-mb 1]
                                          [--warmup 2] [--repeats 5] [--rounds 2] [--json] [--out FILE]

For each world size and each variant, a fresh group of gloo processes (CPU, one thread each) builds
the recipe's model at DP = world size, EP = 1, and runs `TrainEngine.train_step` (the trainer's
step: Megatron's schedule over `--micro-batches` accumulated micro-batches, gradient
reduce-scatter, global norm, clip, AdamW on the shards, parameter all-gather) on random tokens,
each rank its own. Each variant runs in its own processes so that the peak memory is its own.

What is measured, per timed step (after `--warmup` steps), on every rank:
- step time: wall time of `train_step` (the median over steps, the max over ranks: the slowest
  rank sets the pace). The variants take turns, `--rounds` times over (no_overlap, default,
  no_overlap, ...), so a change in the machine's load hits them alike; the median is over the
  steps of every round.
- communication: each bucket's gradient reduce-scatter and parameter all-gather, its launch and
  completion timestamped with `time.perf_counter()`. A synchronous call counts from its start to its
  end; an asynchronous one (overlap) from its launch (a backward hook, or a forward pre-hook for the
  all-gather) to the moment gloo completes it (a callback on the work's future; gloo's coalesced
  reduce-scatter and all-gather have none, so their end is the first moment they are seen complete,
  at the end of the backward or when the step waits for them: an upper bound, which can only
  understate what is hidden). Communication time
  is the union of those intervals; the part of it before the backward ended (when the
  forward-backward schedule returned) is hidden; the rest is exposed (the step waits for it).
- peak memory: the process's peak resident set (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) at the
  end, and its growth from just before the first step (the gradient buffers, optimizer state and
  activations; the imports and the model are in the baseline of both).
Ratios are against the baseline with the same forward precision, measured in the same command
(each row names its baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = {  # name: (overlap_grad_reduce and overlap_param_gather, other overrides, baseline)
    "no_overlap": (False, [], "no_overlap"),
    "default": (True, [], "no_overlap"),
}
BF16_VARIANTS = {  # --bf16
    "default_bf16_forward": (True, ["train.bf16=true"], "default_bf16_forward"),
    "bf16_gradients": (True, ["train.bf16=true", "parallel.grad_reduce_dtype=bf16"], "default_bf16_forward"),
}


class CommClock:
    """Launch/completion timestamps of the engine's collectives and the end of each backward."""

    def __init__(self) -> None:
        self.intervals: list[list[float]] = []
        self.unobserved: list[tuple[list[float], object]] = []
        self.backward_end: float | None = None

    def asynchronous(self, bucket_group, method: str = "start_grad_sync", handle_name: str = "grad_reduce_handle"):
        """Wrap one Megatron bucket group's `start_grad_sync` (or `start_param_sync`, whose handle
        is `param_gather_handle`), this instance only."""
        start_sync = getattr(bucket_group, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            start_sync(*args, **kwargs)
            handle = getattr(bucket_group, handle_name)
            if handle is None:  # synchronous: complete on return
                self.intervals.append([start, time.perf_counter()])
                return
            unobserved = []
            for work in handle.works:
                interval = [start, float("nan")]
                self.intervals.append(interval)
                try:
                    work.get_future().add_done_callback(lambda _f, i=interval: i.__setitem__(1, time.perf_counter()))
                except RuntimeError:  # gloo's coalesced reduce-scatter / all-gather give no future
                    unobserved.append((interval, work))
            if unobserved:
                self.unobserved += unobserved
                wait = handle.wait

                def timed_wait(*args, **kwargs):
                    out = wait(*args, **kwargs)
                    self.observe()
                    return out
                handle.wait = timed_wait
        setattr(bucket_group, method, timed)

    def observe(self) -> None:
        """Completion of works without a future: the first time they are seen complete (at the end
        of the backward, or when the step waits for them): an upper bound on their end."""
        now = time.perf_counter()
        for interval, work in self.unobserved:
            if interval[1] != interval[1] and work.is_completed():
                interval[1] = now
        self.unobserved = [(i, w) for i, w in self.unobserved if i[1] != i[1]]

    def step_summary(self, step_start: float) -> dict:
        """Union of the intervals, and the part of it before the backward ended."""
        now = time.perf_counter()  # a completion callback not yet run (gloo's thread) counts as now
        spans = sorted((max(a, step_start), now if b != b else b) for a, b in self.intervals)
        union, hidden = 0.0, 0.0
        cur = None
        for a, b in spans + [(float("inf"), float("inf"))]:
            if cur is not None and a > cur[1]:
                union += cur[1] - cur[0]
                hidden += max(0.0, min(cur[1], self.backward_end) - cur[0])
                cur = None
            if a == float("inf"):
                break
            cur = [a, b] if cur is None else [cur[0], max(cur[1], b)]
        self.intervals.clear()
        return {"comm_s": union, "hidden_s": hidden}


def _instrument(engine, clock: CommClock) -> None:
    """Timestamps on this engine's collectives and on the end of its forward-backward schedule."""
    forward_backward = engine.forward_backward

    def timed_schedule(*args, **kwargs):
        out = forward_backward(*args, **kwargs)
        clock.backward_end = time.perf_counter()
        clock.observe()
        return out
    engine.forward_backward = timed_schedule
    ddp = engine.grad_sync.ddp
    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        clock.asynchronous(group)  # the gradient reduce-scatter
        clock.asynchronous(group, "start_param_sync", "param_gather_handle")  # the updated parameters' all-gather


def _micro_batches(cfg, n: int, count: int, seed: int):
    import torch

    from megatron_triroute.training.engine import MicroBatch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        tokens = torch.randint(0, cfg.model.vocab_size, (n, cfg.model.seq_len + 1), generator=g)
        out.append(MicroBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
                              torch.ones(n, cfg.model.seq_len), torch.arange(seed * 1000 + i * n, seed * 1000 + (i + 1) * n)))
    return out


def _rank_main(rank: int, world: int, port: int, args: dict, variant: str, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.dup2(2, 1)  # library prints go to stderr: the parent's stdout carries only the result
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from megatron_triroute.distributed.one_process import build_model
        from megatron_triroute.parallel import cpu_shim, destroy_parallel, initialize_parallel
        from megatron_triroute.training.engine import TrainEngine
        from megatron_triroute.training.recipes import resolve
        from megatron_triroute.training.trainer import build_optimizer

        overlap, other, _ = {**VARIANTS, **BF16_VARIANTS}[variant]
        overrides = [*args["overrides"], f"parallel.overlap_grad_reduce={overlap}",
                     f"parallel.overlap_param_gather={overlap}", f"parallel.bucket_mb={args['bucket_mb']}", *other]
        with cpu_shim():
            run = resolve(args["recipe"], overrides)
            groups = initialize_parallel()
            model = build_model(run.triroute, groups, seed=run.data.seed)
            optimizer, grad_sync, scheduler = build_optimizer(model, run, groups)
            engine = TrainEngine(model, groups, optimizer, run.train.steps, run.optim.clip_grad, scheduler,
                                 bf16=run.train.dtype_name == "bf16", grad_sync=grad_sync)
            clock = CommClock()
            _instrument(engine, clock)
            steps = args["warmup"] + args["repeats"]
            data = [_micro_batches(run.triroute, args["micro_batch"], args["micro_batches"], 100 * s + rank)
                    for s in range(steps)]
            rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            rows = []
            for step, mbs in enumerate(data):
                dist.barrier()
                start = time.perf_counter()
                report = engine.train_step(mbs, step)
                elapsed = time.perf_counter() - start
                comm = clock.step_summary(start)
                if report.skipped:
                    raise RuntimeError(f"{variant}: step {step} was skipped (non-finite loss or gradients)")
                if step >= args["warmup"]:
                    rows.append({"step_s": elapsed, **comm})
            rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            buckets = sum(len(g.buckets) for g in engine.grad_sync.ddp.bucket_groups)
            destroy_parallel()
        results.put((rank, {"rows": rows, "peak_rss_mib": rss_after / 1024, "rss_growth_mib": (rss_after - rss_before) / 1024,
                            "params": sum(p.numel() for p in model.parameters()), "dense_buckets": buckets}))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_group(world: int, variant: str, args: dict) -> list[dict]:
    import torch.multiprocessing as mp

    from megatron_triroute.distributed.launch_env import free_local_port

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    os.environ["OMP_NUM_THREADS"] = "1"
    port = free_local_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, variant, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = _collect(results, procs, variant, world)
    for p in procs:
        p.join(timeout=60)
    errors = [v["error"] for v in out.values() if "error" in v]
    if errors:
        raise RuntimeError(f"{variant} at {world} processes failed:\n{errors[0]}")
    return [out[r] for r in range(world)]


def _collect(results, procs, variant: str, world: int, timeout_s: float = 1800) -> dict:
    """Every rank's report; a rank that exits without one (killed, out of memory, a crash in C++)
    fails the group at once instead of leaving the parent waiting on the queue."""
    out: dict = {}
    deadline = time.monotonic() + timeout_s
    while True:
        # Look at the exits before draining: a rank that reported and then exited has its report queued.
        ended = [r for r, p in enumerate(procs) if p.exitcode is not None]
        while not results.empty():
            rank, report = results.get()
            out[rank] = report
        if len(out) == len(procs):
            return out
        dead = [r for r in ended if r not in out]
        if dead or time.monotonic() > deadline:
            codes = [p.exitcode for p in procs]  # None: still running, killed now
            for p in procs:
                p.kill()
                p.join(5)
            why = f"rank(s) {dead} exited without a report" if dead else f"no report within {timeout_s:.0f} s"
            raise RuntimeError(f"{variant} at {world} processes: {why} (exit codes {codes})")
        time.sleep(0.1)


def summarise(rounds: list[list[dict]]) -> dict:
    """Median over steps (of every round) of the slowest rank's step; communication and memory of
    the worst rank. `rounds[k][rank]` is one process group's report."""
    steps = len(rounds[0][0]["rows"])
    step_s = statistics.median(max(r["rows"][i]["step_s"] for r in ranks) for ranks in rounds for i in range(steps))
    ranks = [{"rows": [row for rnd in rounds for row in rnd[rank]["rows"]],
              **{k: max(rnd[rank][k] for rnd in rounds) for k in ("peak_rss_mib", "rss_growth_mib")},
              "params": rounds[0][rank]["params"], "dense_buckets": rounds[0][rank]["dense_buckets"]}
             for rank in range(len(rounds[0]))]
    steps = len(ranks[0]["rows"])
    comm = sum(row["comm_s"] for r in ranks for row in r["rows"])
    hidden = sum(row["hidden_s"] for r in ranks for row in r["rows"])
    return {
        "step_s": step_s,
        "comm_s_per_step": comm / (steps * len(ranks)),
        "exposed_comm_s_per_step": (comm - hidden) / (steps * len(ranks)),
        "hidden_fraction": hidden / comm if comm > 0 else 0.0,
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "rss_growth_mib": max(r["rss_growth_mib"] for r in ranks),
        "params": ranks[0]["params"], "dense_buckets": ranks[0]["dense_buckets"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--bf16", action="store_true", help="also the bf16 forward, with fp32 and bf16 gradients")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch per rank")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches accumulated per step")
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="Megatron gradient bucket size (MB of fp32)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="times each variant runs, taking turns")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    shared = {"recipe": args.recipe, "overrides": args.overrides, "micro_batch": args.micro_batch,
              "micro_batches": args.micro_batches, "bucket_mb": args.bucket_mb, "warmup": args.warmup,
              "repeats": args.repeats, "rounds": args.rounds}
    result = {"recipe": args.recipe, "overrides": args.overrides, **{k: v for k, v in shared.items() if k != "overrides"},
              "memory": "peak RSS, resource.getrusage(RUSAGE_SELF).ru_maxrss", "load_average": os.getloadavg()[0],
              "worlds": {}}
    variants = {**VARIANTS, **(BF16_VARIANTS if args.bf16 else {})}
    for world in args.nprocs:
        reports: dict[str, list] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name in variants:
                reports[name].append(_run_group(world, name, shared))
        per = {name: summarise(rounds) for name, rounds in reports.items()}
        for name, row in per.items():
            row["baseline"] = variants[name][2]
            base = per[row["baseline"]]
            row["step_ratio"] = row["step_s"] / base["step_s"]
            row["peak_rss_ratio"] = row["peak_rss_mib"] / base["peak_rss_mib"]
        result["worlds"][str(world)] = per
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return result


def _print_table(result: dict) -> None:
    print(f"recipe {result['recipe']} {' '.join(result['overrides'])}: {result['micro_batches']} micro-batches of "
          f"{result['micro_batch']} per rank per step, buckets {result['bucket_mb']} MB, {result['repeats']} timed "
          f"steps after {result['warmup']} warm-up, x {result['rounds']} rounds; gloo on CPU, 1 thread per rank; load average {result['load_average']:.2f}")
    print(f"memory: {result['memory']}")
    for world, per in result["worlds"].items():
        print(f"{world} processes (DP={world}), {per['default']['params']:,} parameters:")
        for name, row in per.items():
            print(f"  {name:<20} step {1e3 * row['step_s']:8.1f} ms (x{row['step_ratio']:.2f} {row['baseline']:<15})  "
                  f"comm {1e3 * row['comm_s_per_step']:7.1f} ms, exposed {1e3 * row['exposed_comm_s_per_step']:7.1f} ms, "
                  f"hidden {row['hidden_fraction']:6.1%}  buckets {row['dense_buckets']:3d}  "
                  f"peak RSS {row['peak_rss_mib']:7.1f} MiB (x{row['peak_rss_ratio']:.3f}, +{row['rss_growth_mib']:.1f} MiB in the steps)")


if __name__ == "__main__":
    main()
