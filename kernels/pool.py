"""Paged, precision-segregated KV pools: the storage layout both kernels read and write.

One pool per (layer, K-or-V, bit-width b), fixed page size P tokens:
- b in {2, 4, 8}: `codes` uint8 [num_pages, P, H_kv, d_h * b // 8] (the d_h codes of one
  (token, kv-head) packed along the channel axis, code i of a byte at bit offset i * b, exactly
  `quant.pack_codes`' order for one token and head), `scale` and `zero` float16
  [num_pages, P, H_kv, d_h // g] (exactly `quant.quantize_groups`' scale and zero);
- b = 16: `values` float16 [num_pages, P, H_kv, d_h];
- `token_pos` int32 [num_pages, P]: the per-request sequence position of each slot, -1 when free.
A K pool and the V pool of the same width may share one `token_pos` tensor (`allocate_kv_pools`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import SUPPORTED_BITS


@dataclass
class PagePool:
    """The tensors of one precision pool (see the module docstring for the layout)."""

    bits: int
    group_size: int
    token_pos: torch.Tensor
    codes: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def num_pages(self) -> int:
        return self.token_pos.shape[0]

    @property
    def page_size(self) -> int:
        return self.token_pos.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return (self.values if self.bits >= 16 else self.codes).shape[2]

    @property
    def head_dim(self) -> int:
        if self.bits >= 16:
            return self.values.shape[3]
        return self.codes.shape[3] * 8 // self.bits

    @property
    def device(self) -> torch.device:
        return self.token_pos.device

    def storage_tensors(self) -> list[torch.Tensor]:
        """The payload tensors (codes/scale/zero, or values), token_pos excluded."""
        if self.bits >= 16:
            return [self.values]
        return [self.codes, self.scale, self.zero]

    def bytes_per_slot(self) -> int:
        """Payload bytes one (token) slot occupies across all kv heads, metadata included."""
        return sum(t[0, 0].numel() * t.element_size() for t in self.storage_tensors())


def check_pool_shape(bits: int, head_dim: int, group_size: int) -> None:
    """Raise a ValueError naming the field when (bits, head_dim, group_size) has no pool layout."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not a cache width; use one of {SUPPORTED_BITS}")
    if bits >= 16:
        return
    if group_size <= 0 or head_dim % group_size:
        raise ValueError(f"group_size={group_size} must divide head_dim={head_dim} (groups never span heads)")
    if (head_dim * bits) % 8:
        raise ValueError(f"head_dim={head_dim} at bits={bits} does not fill whole bytes; use a head_dim multiple of {8 // bits}")


def allocate_pool(
    bits: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    group_size: int,
    device: torch.device | str = "cpu",
    token_pos: torch.Tensor | None = None,
) -> PagePool:
    """An empty pool: every slot free (token_pos -1), payload zeroed."""
    check_pool_shape(bits, head_dim, group_size)
    if num_pages < 0 or page_size <= 0:
        raise ValueError(f"num_pages={num_pages} must be >= 0 and page_size={page_size} > 0")
    if token_pos is None:
        token_pos = torch.full((num_pages, page_size), -1, dtype=torch.int32, device=device)
    elif token_pos.shape != (num_pages, page_size) or token_pos.dtype != torch.int32:
        raise ValueError(f"token_pos must be int32 [{num_pages}, {page_size}], got {token_pos.dtype} {tuple(token_pos.shape)}")
    lead = (num_pages, page_size, num_kv_heads)
    if bits >= 16:
        return PagePool(bits, group_size, token_pos, values=torch.zeros(*lead, head_dim, dtype=torch.float16, device=device))
    return PagePool(
        bits,
        group_size,
        token_pos,
        codes=torch.zeros(*lead, head_dim * bits // 8, dtype=torch.uint8, device=device),
        scale=torch.zeros(*lead, head_dim // group_size, dtype=torch.float16, device=device),
        zero=torch.zeros(*lead, head_dim // group_size, dtype=torch.float16, device=device),
    )


def allocate_kv_pools(
    bits: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    group_size: int,
    device: torch.device | str = "cpu",
) -> tuple[PagePool, PagePool]:
    """A K pool and a V pool of one width sharing one `token_pos` tensor."""
    k = allocate_pool(bits, num_pages, page_size, num_kv_heads, head_dim, group_size, device)
    v = allocate_pool(bits, num_pages, page_size, num_kv_heads, head_dim, group_size, device, token_pos=k.token_pos)
    return k, v
