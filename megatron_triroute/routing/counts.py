"""How many times each option id occurs, without reading anything back to the host.

`torch.bincount` on CUDA reads the input's maximum back to size its output: a host sync per call,
once per routed axis and layer in the auxiliary losses, where the host then waits for the device.
A `scatter_add_` into a zero tensor of the known width gives the same counts with no read.
"""

from __future__ import annotations

import torch


def option_counts(ids: torch.Tensor, n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """(n,) occurrences of each id in [0, n) among `ids` (any shape, integer); `torch.bincount(ids,
    minlength=n)` for ids below n, with no host read."""
    flat = ids.reshape(-1).long()
    counts = torch.zeros(n, dtype=dtype, device=ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=dtype))
