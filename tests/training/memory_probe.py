"""Peak resident memory of three real training steps of the tiny recipe at a given shape, above the
idle process (run as `python -m tests.training.memory_probe key=value ...` in a fresh process):
prints JSON with the measurement and the planner's estimate for the same config."""

import json
import os
import sys

import torch
import torch.distributed as dist


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def main(overrides: list[str]) -> None:
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron_triroute.model.gpt import TriRouteGPTModel
    from megatron_triroute.model.spec import transformer_config
    from megatron_triroute.parallel import cpu_shim, initialize_parallel
    from megatron_triroute.training.config import apply_overrides
    from megatron_triroute.training.data import MicroBatch
    from megatron_triroute.training.engine import TrainEngine
    from megatron_triroute.training.planner import estimate_rank_memory
    from megatron_triroute.training.recipes import get_recipe
    from megatron_triroute.training.trainer import build_optimizer

    shim = cpu_shim()
    shim.__enter__()  # for the life of this probe process
    run = apply_overrides(get_recipe("tiny"), overrides).validate(1)
    groups = initialize_parallel(1, 1, 1)
    torch.manual_seed(0)
    idle = _status("VmRSS")
    mcfg = transformer_config(run.triroute, tensor_parallel=1, pipeline_parallel=1, recompute=run.train.recompute)
    model = TriRouteGPTModel(mcfg, run.triroute, groups=groups)
    optimizer, grad_sync, scheduler = build_optimizer(model, run, groups)
    engine = TrainEngine(model, groups, optimizer, run.train.steps, 1.0, scheduler, bf16=False, grad_sync=grad_sync)
    m, t = run.triroute.model, run.train
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        batches = []
        for k in range(t.global_batch_size // t.micro_batch_size):
            tok = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_len + 1), generator=g)
            batches.append(MicroBatch(tok[:, :-1], tok[:, 1:], torch.ones(t.micro_batch_size, m.seq_len),
                                      torch.arange(k * t.micro_batch_size, (k + 1) * t.micro_batch_size)))
        engine.train_step(batches, step)
    peak = _status("VmHWM")
    print(json.dumps({"measured_gib": (peak - idle) / 2**30, **estimate_rank_memory(run, 1)}))


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main(sys.argv[1:])
