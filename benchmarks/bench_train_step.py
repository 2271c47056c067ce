"""Wall time of one training step, TriRoute vs Dense on the same backbone (not run in CI).

    python benchmarks/bench_train_step.py [--recipe tiny] [key=value ...] [--micro-batch 8]
                                          [--warmup 2] [--repeats 7] [--json]

Both models are built in this process from one recipe: TriRoute as the recipe configures it,
Dense as `system_config("dense", <that config>)`, so they share the backbone (width, layers,
heads, sequence, vocabulary). They are at equal active FLOPs in the paper's sense: each expert is
`d_ff / top_k` wide, so a token routed to k real experts with `full` attention on every head
costs exactly a dense token (realised FLOPs fraction 1.0); the controller's decisions pull
TriRoute below that, and the realised fraction printed is the noise-free hard cost of the timed
steps, as the step report gives it.

A step is `TrainEngine.train_step` on one micro-batch: forward + backward (Megatron's schedule),
gradient reduction, clipping, AdamW, router statistics and budget update. After `--warmup` steps
of each model, the two models alternate step by step for `--repeats` steps each (so drift in the
machine's load hits both alike) and the median is reported. Training runs the relaxed path (every
head computes local and full attention, DeepSpeed dispatches with no drops), whose cost does not
shrink with the realised fraction: the ratio is the training-time overhead, not an inference
speed-up.
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

from megatron_triroute.overhead import build_model, library_logs_to_stderr, single_process_parallel  # noqa: E402
from megatron_triroute.systems import system_config  # noqa: E402
from megatron_triroute.training.engine import MicroBatch, TrainEngine  # noqa: E402
from megatron_triroute.training.recipes import resolve  # noqa: E402


def _micro_batch(cfg, n: int, seed: int) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (n, cfg.model.seq_len + 1), generator=g)
    return MicroBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
                      torch.ones(n, cfg.model.seq_len), torch.arange(n))


def _engine(cfg, groups, run):
    model = build_model(cfg, groups, seed=run.data.seed)
    o = run.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay)
    return TrainEngine(model, groups, optimizer, total_steps=run.train.steps, clip_grad=o.clip_grad)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    run = resolve(args.recipe, args.overrides)
    configs = {run.system: run.triroute.validate(), "dense": system_config("dense", run.triroute)}
    times: dict[str, list[float]] = {name: [] for name in configs}
    cpu_times: dict[str, list[float]] = {name: [] for name in configs}
    realised: list[float] = []
    with library_logs_to_stderr(), single_process_parallel() as groups:  # applies the CPU workarounds
        engines = {name: _engine(cfg, groups, run) for name, cfg in configs.items()}
        data = [_micro_batch(configs["dense"], args.micro_batch, seed) for seed in range(args.warmup + args.repeats)]
        for step, mb in enumerate(data):
            for name, engine in engines.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                report = engine.train_step([mb], step)
                elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
                if report.skipped:
                    raise RuntimeError(f"{name}: step {step} was skipped (non-finite loss or gradients)")
                if step >= args.warmup:
                    times[name].append(elapsed)
                    cpu_times[name].append(elapsed_cpu)
                    if name == run.system:
                        realised.append(report.realised[0])
    system = run.system
    m = configs[system].model
    tokens = args.micro_batch * m.seq_len
    median = {name: statistics.median(t) for name, t in times.items()}
    median_cpu = {name: statistics.median(t) for name, t in cpu_times.items()}
    result = {
        "recipe": run.name, "system": system, "micro_batch": args.micro_batch, "seq_len": m.seq_len,
        "d_model": m.d_model, "n_layers": m.n_layers, "warmup": args.warmup, "repeats": args.repeats,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "median_s": median, "tokens_per_s": {n: tokens / s for n, s in median.items()},
        "median_cpu_s": median_cpu,
        "ratio": median[system] / median["dense"], "cpu_ratio": median_cpu[system] / median_cpu["dense"],
        "realised_flops_fraction": statistics.mean(realised),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"recipe {run.name}: d={m.d_model}, {m.n_layers} layers, seq {m.seq_len}, micro-batch "
              f"{args.micro_batch}; {args.repeats} timed steps each after {args.warmup} warm-up, "
              f"{result['threads']} threads, load average {result['load_average']}")
        for name in configs:
            print(f"  {name:<10} median {1e3 * median[name]:9.1f} ms/step  "
                  f"{result['tokens_per_s'][name]:10.0f} tokens/s"
                  f"  (process CPU time {1e3 * median_cpu[name]:9.1f} ms/step)")
        print(f"  ratio {system}/dense: {result['ratio']:.2f} wall, {result['cpu_ratio']:.2f} CPU time;   "
              f"realised FLOPs fraction of {system}: {result['realised_flops_fraction']:.3f}")
    return result


if __name__ == "__main__":
    main()
