"""Peak resident memory of three real training steps of the tiny recipe at a given shape, above the
idle process (run as `python -m tests.training.memory_probe [--world=N] key=value ...` in a fresh
process): prints JSON with the measurement (the most loaded rank's) and the planner's estimate for
the same config. `--world=N` runs N data-parallel ranks (gloo), each measuring itself.

The process allocator is set to return every freed block of 64 KiB or more to the system
(`M_MMAP_THRESHOLD`, which also stops glibc from raising that threshold as blocks are freed), so the
resident peak is the live tensors' peak plus the interpreter's and libraries' own memory, as the
planner models a GPU's allocated bytes. With glibc's default the heap keeps freed activations and
the resident size creeps up step after step (at the held-out shape: 0.20, 0.22, 0.24, 0.30, 0.31
GiB after steps 1-5, while the live tensors after each step stay at 62 MiB), so the figure would
depend on the number of steps measured.

The idle process has already imported every library the steps load, TorchDynamo included (torch.optim
imports it when the first optimizer is built): their code and tables are not the step's memory.
"""

import ctypes
import json
import os
import sys

import torch
import torch.distributed as dist

M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter: allocations at least this large are mmapped, and unmapped on free."""


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _return_freed_memory() -> None:
    if not ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 64 * 1024):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) refused: the probe needs glibc's allocator")


def main(rank: int, world: int, overrides: list[str]) -> None:
    _return_freed_memory()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_triroute.model.gpt import TriRouteGPTModel
    from megatron_triroute.model.spec import transformer_config
    from megatron_triroute.parallel import cpu_shim, initialize_parallel
    from megatron_triroute.training.config import apply_overrides
    from megatron_triroute.training.data import MicroBatch
    from megatron_triroute.training.engine import TrainEngine
    from megatron_triroute.training.planner import estimate_rank_memory
    from megatron_triroute.training.recipes import get_recipe
    from megatron_triroute.training.trainer import build_optimizer
    import torch._dynamo  # noqa: F401  (torch.optim imports it at the first optimizer: a library, not the step's)

    shim = cpu_shim()
    shim.__enter__()  # for the life of this probe process
    run = apply_overrides(get_recipe("tiny"), overrides).validate(world)
    groups = initialize_parallel(1, 1, 1)
    torch.manual_seed(0)
    idle = _status("VmRSS")
    mcfg = transformer_config(run.triroute, tensor_parallel=1, pipeline_parallel=1, recompute=run.train.recompute)
    model = TriRouteGPTModel(mcfg, run.triroute, groups=groups)
    optimizer, grad_sync, scheduler = build_optimizer(model, run, groups)
    engine = TrainEngine(model, groups, optimizer, run.train.steps, 1.0, scheduler, bf16=False, grad_sync=grad_sync)
    m, t = run.triroute.model, run.train
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        batches = []
        for k in range(t.global_batch_size // (t.micro_batch_size * world)):
            tok = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_len + 1), generator=g)
            batches.append(MicroBatch(tok[:, :-1], tok[:, 1:], torch.ones(t.micro_batch_size, m.seq_len),
                                      torch.arange(k * t.micro_batch_size, (k + 1) * t.micro_batch_size)))
        engine.train_step(batches, step)
    peak = torch.tensor([float(_status("VmHWM") - idle)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"measured_gib": peak.item() / 2**30, **estimate_rank_memory(run, world)}))
    dist.destroy_process_group()


def _spawned(rank: int, world: int, overrides: list[str]) -> None:
    main(rank, world, overrides)


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    args = sys.argv[1:]
    world = int(args.pop(0).removeprefix("--world=")) if args and args[0].startswith("--world=") else 1
    if world == 1:
        main(0, 1, args)
    else:
        torch.multiprocessing.spawn(_spawned, args=(world, args), nprocs=world)
