"""Where tensors live for collectives and compute: NCCL reduces only CUDA tensors, gloo only CPU ones."""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device(group: object = None) -> torch.device:
    """The device of tensors handed to a collective over `group`: the current CUDA device under
    NCCL, the CPU under gloo (or when torch.distributed is not initialised)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (the CPU for a module without parameters)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
