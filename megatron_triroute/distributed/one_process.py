"""A Megatron/DeepSpeed model in this process, with no launcher: a world of one.

What a one-process tool needs to hold the training model (`TriRouteGPTModel`, Megatron-Core and
DeepSpeed modules): the controller-overhead measurement (evaluation/overhead.py), the Hugging Face
import (export/importer.py), the benchmarks and the tests. Training and inference never come here:
a run builds its groups from its launcher (training/trainer.py), the engine needs no groups.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import torch

from ..config import TriRouteConfig


@contextlib.contextmanager
def single_process_parallel(backend: str = "gloo") -> Iterator[object]:
    """torch.distributed (`backend`, world of one: gloo for CPU tensors, nccl for CUDA ones) and
    Megatron/DeepSpeed parallel state for building a model in this process, inside the CPU shim;
    torn down on exit (torch.distributed only if this call created it). The rendezvous variables are
    set for the call only and restored after: a caller's environment (and every process it starts
    later) keeps what it had; the group meets through an in-process store (no port to collide on,
    `launch_env.init_process_group`)."""
    import torch.distributed as dist

    from .launch_env import init_process_group
    from ..parallel import cpu_shim, destroy_parallel, initialize_parallel

    created = not dist.is_initialized()
    saved = {}
    if created:
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            saved[name] = os.environ.get(name)
            os.environ[name] = value
    try:
        if created:
            init_process_group(backend, 0, 1)
        with cpu_shim():  # the CPU workarounds for as long as the models built here run
            try:
                yield initialize_parallel(1, 1, 1)
            finally:
                destroy_parallel()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def build_model(cfg: TriRouteConfig, groups, seed: int = 1234):
    """A TriRouteGPTModel of `cfg` on the CPU, fp32, local (non-TE) linears."""
    from ..model.gpt import TriRouteGPTModel
    from ..model.spec import transformer_config

    torch.manual_seed(seed)
    return TriRouteGPTModel(transformer_config(cfg), cfg, groups=groups, use_te=False)


@contextlib.contextmanager
def library_logs_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 to stderr meanwhile (library loggers hold their own stdout handle)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
