"""Paged, precision-segregated KV cache: per layer one pool of fixed-size pages per bit-width.

A page holds `page_size` token slots. One slot stores one token's K and V for every KV head in
the layout `routing.quant.pack_kv` gives one (token, head): for b < 16 bits, d_h * b / 8 bytes of
codes packed little-end first (code i of a byte sits at bit i * b), then one float16 scale and one
float16 zero per quantisation group; for 16 bits the float16 values themselves. Slot i of a
pool's storage therefore takes exactly `quant.kv_bits_per_token(b, d_kv, g) / 8` bytes, and a
read dequantises with `quant.dequantize_groups`, the very arithmetic `quant.fake_quantize` uses,
so every cached K/V is bit-identical to what training wrote (16 bits: the float16 value, as
`pack_kv` and the cost model count it).

Each request owns, per layer and pool, a list of page ids and a slot count; the positions of the
tokens it stored there are kept beside the codes (a pool holds only the tokens that chose its
width, in increasing position). Pages come from a free list, return to it when a request ends
and are reused; storage grows by doubling only when the free list is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..routing.quant import dequantize_groups, kv_bits_per_token, pack_codes, quantize_groups, unpack_codes


class PagePool:
    """All pages of one (layer, bit-width): storage tensors indexed [page, slot, K/V, kv head, ...]."""

    def __init__(self, bits: int, n_kv_heads: int, d_head: int, group_size: int, page_size: int,
                 initial_pages: int = 4, device=None):
        if bits < 16 and (d_head * bits) % 8:
            raise ValueError(f"d_head={d_head} at {bits} bits does not fill whole bytes; use d_head a multiple of {8 // bits}")
        self.bits, self.n_kv, self.d_head, self.group, self.page_size = bits, n_kv_heads, d_head, group_size, page_size
        self.device = device
        self.storage: dict[str, torch.Tensor] = {}
        self._allocate(max(1, initial_pages))
        self.free: list[int] = list(range(self.num_pages))[::-1]

    # -- storage -------------------------------------------------------------------------------
    def _shapes(self, pages: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        P, n, d = self.page_size, self.n_kv, self.d_head
        if self.bits >= 16:
            return {"values": ((pages, P, 2, n, d), torch.float16), "positions": ((pages, P), torch.int64)}
        return {
            "codes": ((pages, P, 2, n, d * self.bits // 8), torch.uint8),
            "scale": ((pages, P, 2, n, d // self.group), torch.float16),
            "zero": ((pages, P, 2, n, d // self.group), torch.float16),
            "positions": ((pages, P), torch.int64),
        }

    def _allocate(self, pages: int) -> None:
        old = self.storage
        self.storage = {name: torch.zeros(shape, dtype=dtype, device=self.device)
                        for name, (shape, dtype) in self._shapes(pages).items()}
        for name, tensor in old.items():
            self.storage[name][: tensor.shape[0]] = tensor

    @property
    def num_pages(self) -> int:
        return self.storage["positions"].shape[0]

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token slot, from the storage itself (positions excluded: index overhead)."""
        return sum(t[0, 0].nbytes for name, t in self.storage.items() if name != "positions")

    @property
    def page_bytes(self) -> int:
        return sum(t[0].nbytes for name, t in self.storage.items() if name != "positions")

    def alloc(self) -> int:
        if not self.free:
            n = self.num_pages
            self._allocate(2 * n)
            self.free = list(range(n, 2 * n))[::-1]
        return self.free.pop()

    def release(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))

    # -- write / read --------------------------------------------------------------------------
    def write(self, page: torch.Tensor, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              positions: torch.Tensor) -> None:
        """Store tokens: page, slot, positions (N,); k, v (N, H_kv, d_h) float."""
        x = torch.stack([k, v], 1)  # (N, 2, H_kv, d_h)
        s = self.storage
        s["positions"][page, slot] = positions
        if self.bits >= 16:
            s["values"][page, slot] = x.half()
            return
        codes, scale, zero = quantize_groups(x, self.bits, self.group)  # (N, 2, H_kv, d/g, g), (N, 2, H_kv, d/g)
        s["codes"][page, slot] = pack_codes(codes.flatten(-2), self.bits)
        s["scale"][page, slot] = scale
        s["zero"][page, slot] = zero

    def read(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dequantised K, V (..., P, H_kv, d_h) float32 and positions (..., P) of `pages` (...)."""
        s = self.storage
        if self.bits >= 16:
            x = s["values"][pages].float()
        else:
            codes = unpack_codes(s["codes"][pages], self.bits)  # (..., P, 2, H_kv, d_h)
            codes = codes.reshape(*codes.shape[:-1], self.d_head // self.group, self.group)
            x = dequantize_groups(codes, s["scale"][pages], s["zero"][pages])
        return x[..., 0, :, :], x[..., 1, :, :], s["positions"][pages]


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
        self.pools = [PagePool(b, n_kv_heads, d_head, group_size, page_size, initial_pages, device) for b in bits]
        self.page_size = page_size
        self.bits_per_token = [kv_bits_per_token(b, n_kv_heads * d_head, group_size) for b in bits]


class PagedKVCache:
    """The whole model's cache: `layers[l].pools[option]`, and per request its page lists."""

    def __init__(self, n_layers: int, bits: tuple[int, ...], n_kv_heads: int, d_head: int, group_size: int,
                 page_size: int = 16, initial_pages: int = 4, device=None):
        self.page_size = page_size
        self.layers = [LayerCache(bits, n_kv_heads, d_head, group_size, page_size, initial_pages, device)
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
            table = []
            for b, n in enumerate(counts):  # per request: allocate the pages its new slots need
                entry = self.requests[rids[b]][layer][o]
                while len(entry.pages) * P < entry.count + n:
                    entry.pages.append(pool.alloc())
                table.append(entry)
            starts = torch.tensor([e.count for e in table], dtype=torch.long, device=rows.device)
            # Rank of each token among its request's new tokens (tokens are ordered by request, position).
            first = torch.cumsum(torch.tensor([0] + counts[:-1], device=rows.device), 0)
            order = torch.argsort(rows, stable=True)
            rank = torch.empty_like(rows)
            rank[order] = torch.arange(rows.numel(), device=rows.device) - first[rows[order]]
            slot_index = starts[rows] + rank
            width = max(len(e.pages) for e in table)
            pages = torch.tensor([e.pages + [0] * (width - len(e.pages)) for e in table], dtype=torch.long,
                                 device=rows.device)
            pool.write(pages[rows, slot_index // P], slot_index % P, k[sel], v[sel], positions[sel])
            for b, n in enumerate(counts):
                table[b].count += n
            self.bytes_written += sel.numel() * pool.slot_bytes

    def page_table(self, layer: int, option: int, rids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, max pages) page ids (padded with 0) and (B,) slot counts of pool `option`."""
        entries = [self.requests[r][layer][option] for r in rids]
        width = max([len(e.pages) for e in entries] + [0])
        table = torch.tensor([e.pages + [0] * (width - len(e.pages)) for e in entries], dtype=torch.long)
        counts = torch.tensor([e.count for e in entries], dtype=torch.long)
        return table.view(len(rids), width), counts

    # -- accounting ----------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes at rest, measured from the storage: `used` (filled slots), `slack` (unfilled
        slots of allocated pages), `index` (the positions kept beside the codes)."""
        used = slack = index = 0
        for l, layer in enumerate(self.layers):
            for o, pool in enumerate(layer.pools):
                for entries in self.requests.values():
                    e = entries[l][o]
                    used += e.count * pool.slot_bytes
                    slack += (len(e.pages) * self.page_size - e.count) * pool.slot_bytes
                    index += len(e.pages) * pool.storage["positions"][0].nbytes
        return {"used": used, "slack": slack, "index": index}
