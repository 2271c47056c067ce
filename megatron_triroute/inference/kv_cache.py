"""Paged, precision-segregated KV cache: per layer one pool of fixed-size pages per bit-width.

The pages are `triroute_kernels` pools (`triroute_kernels.pool` documents the layout), written by
`triroute_kernels.quantize_pack_into` and read by its dequantiser and decode-attention kernel
(the torch twins on CPU, Triton on CUDA): the engine has no packing code of its own. Per
(layer, width) a K pool and a V pool share one `token_pos` index. One slot stores one token's K
(or V) for every KV head; per (token, head), for b < 16 bits, d_h * b / 8 bytes of codes
(`triroute_kernels.quant.pack_codes`' order: code i of a byte at bit i * b) and one float16 scale and
zero per quantisation group (`quantize_groups`'); for 16 bits the float16 values. A token's K and V
therefore take exactly `routing.quant.kv_bits_per_token(b, d_kv, g) / 8` bytes, and every cached K/V
dequantises bit-identically to `routing.quant.fake_quantize` of the training code (tested at 2/4/8/16 bits).

Each request owns, per layer and pool, a list of page ids and a slot count; `token_pos` holds the
position of the token in each slot (-1 when free), and a pool holds only the tokens that chose its
width, in increasing position. Pages come from a free list, return to it (slots marked free) when
a request ends and are reused; storage grows by doubling only when the free list is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from triroute_kernels import allocate_kv_pools, dequantize_slots, quantize_pack_into

from ..routing.quant import kv_bits_per_token


class WidthPool:
    """All pages of one (layer, bit-width): a K and a V `triroute_kernels.PagePool` and a free list
    (the engine's allocator around the kernels' storage)."""

    def __init__(self, bits: int, n_kv_heads: int, d_head: int, group_size: int, page_size: int,
                 initial_pages: int = 4, device=None):
        self.bits, self.n_kv, self.d_head, self.group, self.page_size = bits, n_kv_heads, d_head, group_size, page_size
        self.device = torch.device(device or "cpu")
        self.k, self.v = allocate_kv_pools(bits, max(1, initial_pages), page_size, n_kv_heads, d_head, group_size,
                                           self.device)
        self.free: list[int] = list(range(self.num_pages))[::-1]

    @property
    def token_pos(self) -> torch.Tensor:
        """int32 (pages, P): the position held by each slot, -1 when free (shared by K and V)."""
        return self.k.token_pos

    @property
    def num_pages(self) -> int:
        return self.k.num_pages

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token's K and V, from the storage itself (token_pos excluded: index overhead)."""
        return self.k.bytes_per_slot() + self.v.bytes_per_slot()

    @property
    def page_bytes(self) -> int:
        return self.slot_bytes * self.page_size

    @property
    def index_bytes_per_page(self) -> int:
        return self.token_pos[0].nbytes

    def _grow(self, pages: int) -> None:
        """Reallocate with `pages` pages, keeping the contents of the old ones."""
        n = self.num_pages
        k, v = allocate_kv_pools(self.bits, pages, self.page_size, self.n_kv, self.d_head, self.group, self.device)
        k.token_pos[:n] = self.token_pos
        for old, new in ((self.k, k), (self.v, v)):
            for src, dst in zip(old.storage_tensors(), new.storage_tensors()):
                dst[:n] = src
        self.k, self.v = k, v

    def alloc(self) -> int:
        if not self.free:
            n = self.num_pages
            self._grow(2 * n)
            self.free = list(range(n, 2 * n))[::-1]
        return self.free.pop()

    def release(self, pages: list[int]) -> None:
        if pages:
            self.token_pos[torch.tensor(pages, dtype=torch.long, device=self.device)] = -1
            self.free.extend(reversed(pages))

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store tokens at flat slots (page * P + offset) (N,); k, v (N, H_kv, d_h) float; positions (N,)."""
        self.token_pos.view(-1)[slots] = positions.to(torch.int32)
        quantize_pack_into(k.contiguous(), self.bits, self.group, self.k, slots)
        quantize_pack_into(v.contiguous(), self.bits, self.group, self.v, slots)

    def read(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dequantised K, V (..., P, H_kv, d_h) float32 and positions (..., P) of `pages` (...);
        absent pages (id -1) read as empty slots (position -1)."""
        present = pages >= 0
        ids = pages.clamp(min=0)
        pos = torch.where(present.unsqueeze(-1), self.token_pos[ids], -1)
        return dequantize_slots(self.k, ids), dequantize_slots(self.v, ids), pos


@dataclass
class PoolPages:
    """One request's pages in one pool of one layer."""

    pages: list[int] = field(default_factory=list)
    count: int = 0
    """Slots filled (the request's tokens stored at this width in this layer)."""


class LayerCache:
    """One layer's pools, one per bit-width option (in `bits` order)."""

    def __init__(self, bits: tuple[int, ...], n_kv_heads: int, d_head: int, group_size: int, page_size: int,
                 initial_pages: int = 4, device=None):
        self.bits = tuple(bits)
        self.pools = [WidthPool(b, n_kv_heads, d_head, group_size, page_size, initial_pages, device) for b in bits]
        self.page_size = page_size
        self.bits_per_token = [kv_bits_per_token(b, n_kv_heads * d_head, group_size) for b in bits]


class PagedKVCache:
    """The whole model's cache: `layers[l].pools[option]`, and per request its page lists."""

    def __init__(self, n_layers: int, bits: tuple[int, ...], n_kv_heads: int, d_head: int, group_size: int,
                 page_size: int = 16, initial_pages: int = 4, device=None):
        self.page_size = page_size
        self.group_size = group_size
        self.device = torch.device(device or "cpu")
        self.layers = [LayerCache(bits, n_kv_heads, d_head, group_size, page_size, initial_pages, self.device)
                       for _ in range(n_layers)]
        self.requests: dict[int, list[list[PoolPages]]] = {}
        self.bytes_written = 0

    def add_request(self, rid: int) -> None:
        if rid in self.requests:
            raise ValueError(f"request {rid} already holds cache pages")
        self.requests[rid] = [[PoolPages() for _ in layer.pools] for layer in self.layers]

    def free_request(self, rid: int) -> None:
        """Return every page of request `rid` to its pool's free list."""
        for layer, entries in zip(self.layers, self.requests.pop(rid)):
            for pool, entry in zip(layer.pools, entries):
                pool.release(entry.pages)

    def write(self, layer: int, rids: list[int], row: torch.Tensor, option: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Append tokens to their request's pool of their chosen width. row (N,) index into `rids`
        (tokens of one request in increasing position), option (N,) bit option, positions (N,);
        k, v (N, H_kv, d_h)."""
        cache, P = self.layers[layer], self.page_size
        for o, pool in enumerate(cache.pools):
            sel = (option == o).nonzero().flatten()
            if sel.numel() == 0:
                continue
            rows = row[sel]
            counts = torch.bincount(rows, minlength=len(rids)).tolist()
            slots = []
            for b, n in enumerate(counts):  # per request: the flat slots of its next n tokens
                if n == 0:
                    continue
                entry = self.requests[rids[b]][layer][o]
                while len(entry.pages) * P < entry.count + n:
                    entry.pages.append(pool.alloc())
                index = torch.arange(entry.count, entry.count + n)
                slots.append(torch.tensor(entry.pages)[index // P] * P + index % P)
                entry.count += n
            # A stable sort on the row lists the tokens request by request, each in position order.
            order = torch.argsort(rows, stable=True)
            flat = torch.empty_like(rows)
            flat[order] = torch.cat(slots).to(rows.device)
            pool.write(flat, k[sel], v[sel], positions[sel])
            self.bytes_written += sel.numel() * pool.slot_bytes

    def page_table(self, layer: int, option: int, rids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, max pages) page ids (padded with -1) and (B,) slot counts of pool `option`, on the cache's device."""
        entries = [self.requests[r][layer][option] for r in rids]
        width = max([len(e.pages) for e in entries] + [0])
        table = torch.tensor([e.pages + [-1] * (width - len(e.pages)) for e in entries], dtype=torch.long)
        counts = torch.tensor([e.count for e in entries], dtype=torch.long)
        return table.view(len(rids), width).to(self.device), counts.to(self.device)

    # -- accounting ----------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes at rest, measured from the storage: `used` (filled slots), `slack` (unfilled
        slots of allocated pages), `index` (the int32 positions kept beside the codes)."""
        used = slack = index = 0
        for l, layer in enumerate(self.layers):
            for o, pool in enumerate(layer.pools):
                for entries in self.requests.values():
                    e = entries[l][o]
                    used += e.count * pool.slot_bytes
                    slack += (len(e.pages) * self.page_size - e.count) * pool.slot_bytes
                    index += len(e.pages) * pool.index_bytes_per_page
        return {"used": used, "slack": slack, "index": index}
