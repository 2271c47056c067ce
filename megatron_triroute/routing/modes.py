"""The attention read modes and what each reads: the one definition every path uses.

A query at 0-based position t in mode m reads the keys [read_start(t, m), t] (Sec. axes, axis A):
skip reads nothing (start t + 1, an empty range), local reads the window max(0, t - w) .. t, full
reads 0 .. t. Training's relaxed attention (model/attention.py), the cost model (routing/cost.py),
the inference engine (inference/attention.py) and, through the ranges the engine hands them, the
kernels (`triroute_kernels`, which take [lo, hi] per query and know no modes) all read it here.

Adding a mode: append its name to `ATTN_MODES` and its start to `read_start`; every shape that holds
one value per mode is sized by `N_MODES`.
"""

from __future__ import annotations

import torch

from .device_values import device_constant

ATTN_MODES = ("skip", "local", "full")
"""Attention read modes, in logit order (index 0 = skip)."""
SKIP, LOCAL, FULL = range(len(ATTN_MODES))
"""Option indices of the attention read modes."""
N_MODES = len(ATTN_MODES)
"""Options of the attention head per query head (the last axis of every mode tensor)."""
READING_MODES = tuple(m for m in range(N_MODES) if m != SKIP)
"""Modes that read keys (each has its own attention output in the relaxed path)."""


_FULL_REACH = 1 << 62
"""How far back `full` reaches: past position 0 for any sequence."""


def reach_by_mode(window: int) -> list[int]:
    """Per mode, how many keys before the query it reaches back: skip -1 (its start is past the
    query), local `window`, full everything."""
    reach = [0] * N_MODES
    reach[SKIP], reach[LOCAL], reach[FULL] = -1, window, _FULL_REACH
    return reach


def _reach(window: int, like: torch.Tensor) -> torch.Tensor:
    """`reach_by_mode` as a tensor (a kept constant per window, device and dtype)."""
    return device_constant(reach_by_mode(window), like.dtype, like.device)


def read_start(positions: torch.Tensor, mode, window: int) -> torch.Tensor:
    """First key a query at `positions` reads in `mode` (an int or a tensor broadcastable to
    `positions`; None: every mode, along a new last axis of N_MODES): max(0, position - reach(mode)),
    so skip starts at `positions + 1` (an empty range), local at max(0, t - w), full at 0. Keys
    read: [start, position]."""
    if mode is None:
        t = positions.unsqueeze(-1)
        return (t - _reach(window, t)).clamp_min(0)
    t = positions
    reach = _reach(window, t)
    # an int selects on the host; a 0-d index tensor would be read back (a device sync on a GPU)
    reach = reach[mode] if isinstance(mode, int) else reach[torch.as_tensor(mode, device=t.device)]
    return (t - reach).clamp_min(0)


def keys_read(positions: torch.Tensor, window: int) -> torch.Tensor:
    """(..., N_MODES) float64: how many keys a query at `positions` reads in each mode."""
    t = positions.to(torch.float64)
    return t.unsqueeze(-1) + 1.0 - read_start(t, None, window)


def read_mask(T: int, mode: int, window: int, device=None) -> torch.Tensor:
    """(T, T) bool [query, key]: which keys a query of a length-T sequence reads in `mode`."""
    q = torch.arange(T, device=device).view(T, 1)
    k = torch.arange(T, device=device).view(1, T)
    return (k >= read_start(q, mode, window)) & (k <= q)
