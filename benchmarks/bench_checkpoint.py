"""How long a checkpoint save blocks the training loop, blocking vs asynchronous (`train.async_save`),
and how long a resume takes, at a paper-scale model shape on the CPU.

One process (a gloo group of one, inside the CPU shim) builds the recipe's TriRoute model
(`overhead.build_model`, fp32) and the trainer's distributed AdamW (`trainer.build_optimizer`), with
moments populated by one step. A "training step" here is one AdamW step over every parameter (it
writes every parameter and moment page, as a real step does, so the forked writer's copy-on-write
costs are paid). Rounds alternate a blocking save and an asynchronous one, the same way
`trainer.train` drives them (`run_state.save_run`, then `AsyncSaves.poll` after each step until
the commit):

- blocking stall: the whole `save_run` (snapshot, write, fsync, hash, commit);
- async stall: `save_run` with `saves` (planning, snapshot, small files, fork) plus every `poll`
  and the commit;
- async write: from the save until its commit (the background write and hashing), and the mean
  step time meanwhile against the mean step time with no save in flight (the writer competes with
  training for the cores);
- hash: seconds inside `durability.describe_file` per blocking save (the sha256 of every file,
  by the rank that wrote it; an asynchronous save does it in the background);
- resume: `run_state.load_run` of the newest checkpoint (sizes and sha256 of every file verified,
  then every tensor read).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_checkpoint.py --recipe 160m --rounds 3

Prints one JSON line per measurement and a summary: medians with [min, max] over the rounds, and
the async stall as a fraction of the blocking one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="160m")
    parser.add_argument("--rounds", type=int, default=3, help="blocking + async pairs")
    parser.add_argument("--root", default=None, help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args()

    from megatron_triroute.checkpoint import store
    from megatron_triroute.checkpoint.async_save import AsyncSaves
    from megatron_triroute.distributed.one_process import build_model, single_process_parallel
    from megatron_triroute.training.recipes import get_recipe
    from megatron_triroute.training.run_state import load_run, save_run
    from megatron_triroute.training.trainer import build_optimizer

    run = get_recipe(args.recipe)
    run.triroute.model.seq_len = 64  # the sequence length changes no tensor a checkpoint holds
    run.triroute.validate()
    hashing = [0.0]
    real_describe = store.describe_file

    def timed_describe(path):
        t0 = time.perf_counter()
        try:
            return real_describe(path)
        finally:
            hashing[0] += time.perf_counter() - t0

    store.describe_file = timed_describe
    with tempfile.TemporaryDirectory(dir=args.root) as tmp, single_process_parallel() as groups:
        model = build_model(run.triroute, groups)
        optimizer, grad_sync, scheduler = build_optimizer(model, run, groups)
        grad_sync.begin()
        for p in model.parameters():
            p.main_grad.fill_(1e-3)  # the engine's gradient buffer
        grad_sync.finish()
        optimizer.step()
        parameters = sum(p.numel() for p in model.parameters())
        saves = AsyncSaves()
        ckpt = f"{tmp}/checkpoints"
        config = run.to_dict()

        def step() -> float:
            t0 = time.perf_counter()
            optimizer.step()
            return time.perf_counter() - t0

        quiet = [step() for _ in range(2)]
        rows: dict[str, list[float]] = {k: [] for k in ("blocking_stall", "hash", "async_stall", "async_write",
                                                         "step_quiet", "step_during_write", "resume")}
        n = 0
        for round_ in range(args.rounds):
            for mode in ("blocking", "async"):
                n += 1
                hashing[0] = 0.0
                t0 = time.perf_counter()
                save_run(ckpt, n, model, optimizer, scheduler, groups, config, n, 2, saves=saves if mode == "async" else None)
                stall = time.perf_counter() - t0
                if mode == "blocking":
                    rows["blocking_stall"].append(stall)
                    rows["hash"].append(hashing[0])
                    quiet += [step() for _ in range(2)]
                else:
                    during = []
                    while True:
                        during.append(step())
                        t1 = time.perf_counter()
                        committed = saves.poll()
                        stall += time.perf_counter() - t1
                        if committed:
                            break
                    rows["async_stall"].append(stall)
                    rows["async_write"].append(time.perf_counter() - t0)
                    rows["step_during_write"].append(statistics.mean(during))
                print(json.dumps({"round": round_, "mode": mode, "stall_s": round(stall, 3)}), flush=True)
            t0 = time.perf_counter()
            load_run(ckpt, model, optimizer, scheduler, groups)
            rows["resume"].append(time.perf_counter() - t0)
        rows["step_quiet"] = quiet
        size = sum(f.stat().st_size for f in store.latest_valid_checkpoint(ckpt).path.rglob("*") if f.is_file())
    ratios = [a / b for a, b in zip(rows["async_stall"], rows["blocking_stall"])]
    summary = {"recipe": args.recipe, "parameters": parameters, "checkpoint_bytes": size, "rounds": args.rounds,
               "torch_threads": torch.get_num_threads(),
               **{f"{k}_s": spread(v) for k, v in rows.items()}, "async_stall_over_blocking": spread(ratios)}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
