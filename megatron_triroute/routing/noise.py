"""Counter-based Gumbel noise keyed on a token's identity, not on its place in a tensor.

A stateful generator (`torch.rand`) gives a token different noise when the batch is split
differently across data-parallel ranks, when a sequence is sharded across tensor-parallel
ranks, or after a resume. Here every noise value is a pure hash of

    (seed, step, layer, global sample index, position, head, option)

so the same token draws the same noise under any parallel layout, on every rank, and after a
restart. The hash is `lowbias32` (a 32-bit integer finaliser with good avalanche) applied as a
chain over the key fields; it runs on int64 tensors holding 32-bit values, with multiplications
split into 16-bit halves so no intermediate exceeds 2^49 (no signed overflow anywhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finaliser on 32-bit values stored in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash_keys(*keys: torch.Tensor | int) -> torch.Tensor:
    """Hash a broadcastable tuple of integer keys to uniform 32-bit values (int64 tensor)."""
    h: torch.Tensor | None = None
    for i, key in enumerate(keys):
        k = torch.as_tensor(key, dtype=torch.int64) & _MASK32
        # Fold each field in with a distinct odd constant so (a, b) and (b, a) differ.
        k = _mix32(k ^ ((0x9E3779B9 * (i + 1)) & _MASK32))
        h = k if h is None else _mix32(h ^ _mul32(k, 0x85EBCA6B))
    assert h is not None, "hash_keys needs at least one key"
    return h


def uniform_from_keys(*keys: torch.Tensor | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform samples in the open interval (0, 1), one per broadcast key tuple."""
    h = hash_keys(*keys)
    # 24 high bits -> exactly representable in float32; +0.5 keeps both ends open.
    return ((h >> 8).to(torch.float64) + 0.5).div(2.0**24).to(dtype)


@dataclass(frozen=True)
class NoiseKey:
    """The identity of a batch of tokens at one layer and optimizer step.

    `sample_index` (B,) is each sequence's index in the global sample order (the same index
    whatever rank or micro-batch it lands on); `positions` (T,) or (B, T) are positions within
    the full (unsharded) sequence.
    """

    seed: int
    step: int
    layer: int
    sample_index: torch.Tensor
    positions: torch.Tensor

    def gumbel(self, shape: tuple[int, ...], axis: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Gumbel(0, 1) noise of `shape` = (B, T, *rest); `axis` separates the router axes.

        Trailing dims are enumerated in row-major order, so a (B, T, H, M) request gives
        head h, option m the counter h * M + m.
        """
        B, T = shape[0], shape[1]
        rest = shape[2:]
        n_rest = 1
        for s in rest:
            n_rest *= s
        device = self.sample_index.device
        sample = self.sample_index.to(torch.int64).view(B, 1, 1)
        pos = self.positions.to(device, torch.int64)
        pos = pos.view(1, T, 1) if pos.dim() == 1 else pos.view(B, T, 1)
        counter = torch.arange(n_rest, dtype=torch.int64, device=device).view(1, 1, n_rest)
        u = uniform_from_keys(self.seed, self.step, self.layer, axis, sample, pos, counter, dtype=torch.float64)
        g = -torch.log(-torch.log(u))
        return g.to(dtype).view(*shape)
