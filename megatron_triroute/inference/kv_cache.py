"""Paged, precision-segregated KV cache: per layer one pool of fixed-size pages per bit-width.

The pages are `triroute_kernels` pools (`triroute_kernels.pool` documents the layout), written by
the kernels' one cache write and read by their one attention over all pools (C++ on CPU, the
torch twins elsewhere): the engine has no packing code of its own. Per (layer, width) a K pool
and a V pool share one `token_pos` index. One slot stores one token's K (or V) for every KV head;
per (token, head), for b < 16 bits, d_h * b / 8 bytes of codes (`triroute_kernels.quant.pack_codes`'
order) and one float16 scale and zero per quantisation group; for 16 bits the float16 values. A
token's K and V therefore take exactly `routing.quant.kv_bits_per_token(b, d_kv, g) / 8` bytes, and
every cached K/V dequantises bit-identically to `routing.quant.fake_quantize` of the training code.

Decode state on the device. Per layer, `tables[l]` (pools, rows, width) holds each request's page
ids (-1 past its pages; width bucketed to a power of two) and `counts[l]` (pools, rows) its filled
slots, one row per request. A decode step (one token per request) writes and advances them with
tensor ops only (`write_step`): no host read, whatever width each token takes. Because the width
is decided inside the step, the scheduler keeps room for the next token in EVERY pool, outside the
step (`reserve`, vLLM-style): when some request's room runs out it reads the batch's counts once and
gives every pool of every request room for `page_size` more tokens, so decode reads the device once
every `page_size` steps and a request holds at most about two unfilled pages per pool. A prefill
(several tokens per request) takes pages for exactly the tokens each pool receives, once the layer
has chosen its widths (`_fit`: one device read per layer); `trim` afterwards returns any page
beyond room for `page_size` more tokens and sets each request's room.

Pages come from a free list per pool, return to it (slots marked free) when a request ends and
are reused; a pool's storage grows only when its free list runs out, by what is needed plus a
thirty-second, so free storage stays a small fraction of what is held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from triroute_kernels import PoolLists, allocate_kv_pools, cache_append, cache_write, dequantize_slots

from ..routing.quant import kv_bits_per_token

GROWTH_DIVISOR = 32
"""A pool grows by what it needs plus 1/GROWTH_DIVISOR of its size."""


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
        self.free = list(range(n, pages))[::-1] + self.free

    def alloc(self, count: int) -> list[int]:
        """`count` free page ids (growing the storage if the free list is short)."""
        if len(self.free) < count:
            n = self.num_pages
            self._grow(n + count - len(self.free) + n // GROWTH_DIVISOR)
        taken = self.free[len(self.free) - count:][::-1]
        del self.free[len(self.free) - count:]
        return taken

    def release(self, pages: list[int]) -> None:
        if pages:
            self.token_pos[torch.tensor(pages, dtype=torch.long, device=self.device)] = -1
            self.free.extend(reversed(pages))

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
    """Slots filled, as of the last read of the device counts (`sync`)."""


class LayerCache:
    """One layer's pools, one per bit-width option (in `bits` order)."""

    def __init__(self, bits: tuple[int, ...], n_kv_heads: int, d_head: int, group_size: int, page_size: int,
                 initial_pages: int = 4, device=None):
        self.bits = tuple(bits)
        self.group_size = group_size
        self.pools = [WidthPool(b, n_kv_heads, d_head, group_size, page_size, initial_pages, device) for b in bits]
        self.page_size = page_size
        self.bits_per_token = [kv_bits_per_token(b, n_kv_heads * d_head, group_size) for b in bits]
        self._lists: PoolLists | None = None

    def lists(self) -> PoolLists:
        """The pools as the kernels take them (rebuilt only after a pool was reallocated)."""
        if self._lists is None or any(a is not p.k for a, p in zip(self._lists.k_pools, self.pools)):
            self._lists = PoolLists.of([p.k for p in self.pools], [p.v for p in self.pools])
        return self._lists


class PagedKVCache:
    """The whole model's cache: `layers[l].pools[option]`, per request its page lists (host, `requests`)
    and the device decode state (`tables`, `counts`, `row_of`: see the module doc)."""

    def __init__(self, n_layers: int, bits: tuple[int, ...], n_kv_heads: int, d_head: int, group_size: int,
                 page_size: int = 16, initial_pages: int = 4, device=None):
        self.page_size = page_size
        self.group_size = group_size
        self.device = torch.device(device or "cpu")
        self.layers = [LayerCache(bits, n_kv_heads, d_head, group_size, page_size, initial_pages, self.device)
                       for _ in range(n_layers)]
        self.n_pools = len(bits)
        self.requests: dict[int, list[list[PoolPages]]] = {}
        self.row_of: dict[int, int] = {}
        self._rid_of_row: dict[int, int] = {}
        self.room: dict[int, int] = {}
        """Per request: tokens every pool of every layer can still take without a new page."""
        self._free_rows: list[int] = []
        self.tables = torch.full((n_layers, self.n_pools, 0, 1), -1, dtype=torch.long, device=self.device)
        self.counts = torch.zeros(n_layers, self.n_pools, 0, dtype=torch.long, device=self.device)
        self.layer_tables, self.layer_counts = list(self.tables.unbind(0)), list(self.counts.unbind(0))
        """Per layer, views of `tables` and `counts` (taken once per reallocation, not per step)."""
        self.executed = torch.zeros(n_layers, 2, dtype=torch.long, device=self.device)
        """Per layer, what the attention kernel executed: attention MACs, K/V bytes read (cumulative)."""
        self.layer_executed = list(self.executed.unbind(0))
        self.lost = torch.zeros(1, dtype=torch.long, device=self.device)
        """Decode tokens the device's append found no reserved page for (`triroute_kernels.cache_append`
        on the Triton backend, which reads nothing back): read with the counts at `sync`, which
        refuses a nonzero count."""
        self.host_reads = 0
        """Reads of the device counts by the scheduler (`sync`, `_fit`): in decode, one for the whole
        batch every `page_size` steps; in a prefill, one per layer."""
        self._slot_bytes = [torch.tensor([pool.slot_bytes for pool in layer.pools], dtype=torch.long)
                            for layer in self.layers]
        self.layout = 0
        """Counts the reallocations of `tables`, `counts` and any pool: the tensors a step gives its
        kernels are the same objects while it is unchanged."""
        self._decode_state: tuple[int, list[torch.Tensor]] | None = None

    def decode_state(self) -> list[torch.Tensor]:
        """Per layer its counts, executed counters and page tables, then its pools' tensors (the seven
        lists of `PoolLists.tensors`), in one list: what a decode step gives `triroute.decode_layers`,
        built again only after a reallocation (`layout`)."""
        if self._decode_state is None or self._decode_state[0] != self.layout:
            state = []
            for i, layer in enumerate(self.layers):
                state += [self.layer_counts[i], self.layer_executed[i], self.layer_tables[i]]
                for group in layer.lists().tensors:
                    state += group
            self._decode_state = (self.layout, state)
        return self._decode_state[1]

    def slot_bytes(self, layer: int) -> torch.Tensor:
        """(pools,) int64 on the host: one token's K and V bytes in each pool of `layer` (the layout's, fixed)."""
        return self._slot_bytes[layer]

    # -- rows and pages (host, outside a step) ---------------------------------------------------
    def _resize(self, rows: int, width: int) -> None:
        """Reallocate `tables` (L, pools, rows, width) and `counts` (L, pools, rows), keeping contents."""
        L, W = len(self.layers), self.n_pools
        r, w = self.tables.shape[2:]
        tables = torch.full((L, W, rows, width), -1, dtype=torch.long, device=self.device)
        counts = torch.zeros(L, W, rows, dtype=torch.long, device=self.device)
        tables[:, :, :r, :w] = self.tables
        counts[:, :, :r] = self.counts
        self._free_rows = list(range(r, rows))[::-1] + self._free_rows
        self.tables, self.counts = tables, counts
        self.layer_tables, self.layer_counts = list(tables.unbind(0)), list(counts.unbind(0))
        self.layout += 1

    def rows(self, rids: list[int]) -> torch.Tensor:
        """(B,) the decode-state rows of `rids`, on the cache's device."""
        return torch.tensor([self.row_of[r] for r in rids], dtype=torch.long, device=self.device)

    def add_request(self, rid: int) -> None:
        if rid in self.requests:
            raise ValueError(f"request {rid} already holds cache pages")
        if not self._free_rows:
            self._resize(max(4, 2 * self.tables.shape[2]), self.tables.shape[3])
        self.row_of[rid] = self._free_rows.pop()
        self._rid_of_row[self.row_of[rid]] = rid
        self.room[rid] = 0
        self.requests[rid] = [[PoolPages() for _ in layer.pools] for layer in self.layers]

    def free_request(self, rid: int) -> None:
        """Return every page of request `rid` to its pool's free list."""
        for layer, entries in zip(self.layers, self.requests.pop(rid)):
            for pool, entry in zip(layer.pools, entries):
                pool.release(entry.pages)
        row = self.row_of.pop(rid)
        del self.room[rid], self._rid_of_row[row]
        self.tables[:, :, row] = -1
        self.counts[:, :, row] = 0
        self._free_rows.append(row)

    def sync(self, rids: list[int]) -> None:
        """Read the device counts of `rids` into their host entries (one device read)."""
        if not rids:
            return
        L, W, B = self.counts.shape[0], self.n_pools, len(rids)
        read = torch.cat([self.counts[:, :, self.rows(rids)].flatten(), self.lost]).tolist()  # one read
        self.host_reads += 1
        if read[-1]:
            raise RuntimeError(f"{read[-1]} decoded token(s) found no page reserved in their pool and were not "
                               "written to the KV cache, which is now incomplete: a scheduler bug (reserve room "
                               "before each decode step). Fix: serve from a new engine (a new cache), and report the bug")
        counts = [[read[(l * W + o) * B:(l * W + o + 1) * B] for o in range(W)] for l in range(L)]  # (L, pools, B)
        for b, rid in enumerate(rids):
            for l, entries in enumerate(self.requests[rid]):
                for o, entry in enumerate(entries):
                    entry.count = counts[l][o][b]

    def before_step(self, rids: list[int], n: int, audited: bool) -> None:
        """Host side, before a step of n tokens per request: a decode step (n = 1) gets room in every
        pool (a prefill takes exact pages inside the step); an audited step starts the kernels'
        executed counters from zero."""
        if n == 1:
            self.reserve(rids, [1] * len(rids))
        if audited:
            self.executed.zero_()

    def after_step(self, rids: list[int], n: int) -> None:
        """Host side, after a step of n tokens per request: a prefill returns the pages beyond room
        for the next page of tokens and sets each request's room (`trim`)."""
        if n > 1:
            self.trim(rids)

    def reserve(self, rids: list[int], new_tokens: list[int]) -> None:
        """Before a step: room for `new_tokens[b]` more tokens of rids[b] in every pool of every
        layer. Reads the device counts (of the whole batch, once) only when some request's room ran out."""
        if any(self.room[rid] < n for rid, n in zip(rids, new_tokens)):
            # One read for the whole batch, and everyone's room topped up: requests stay in step.
            self.sync(rids)
            self._top_up([(rid, max(n, self.page_size)) for rid, n in zip(rids, new_tokens)])
        for rid, n in zip(rids, new_tokens):
            self.room[rid] -= n

    def _top_up(self, wants: list[tuple[int, int]]) -> None:
        """Give each (rid, room) pages so that every pool can take `room` more tokens (counts synced)."""
        where, ids = [], []
        for rid, room in wants:
            for l, (layer, entries) in enumerate(zip(self.layers, self.requests[rid])):
                for o, (pool, entry) in enumerate(zip(layer.pools, entries)):
                    self._grow_entry(l, o, rid, pool, entry, entry.count + room, where, ids)
            self.room[rid] = room
        self._store_pages(where, ids)

    def _grow_entry(self, l: int, o: int, rid: int, pool: WidthPool, entry: PoolPages, slots: int, where: list,
                    ids: list) -> None:
        """Pages for `slots` filled slots in one (layer, pool, request), noted in (where, ids)."""
        need = -(-slots // self.page_size) - len(entry.pages)
        if need > 0:
            storage = pool.k
            new = pool.alloc(need)
            self.layout += pool.k is not storage  # the pool was reallocated to hold them
            where.extend((l, o, self.row_of[rid], len(entry.pages) + i) for i in range(need))
            entry.pages.extend(new)
            ids.extend(new)

    def _store_pages(self, where: list, ids: list) -> None:
        """Write newly allocated page ids into `tables` (widening it when a list outgrows it)."""
        if ids:
            width = max(c for *_, c in where) + 1
            if width > self.tables.shape[3]:
                self._resize(self.tables.shape[2], 1 << (width - 1).bit_length())
            index = torch.tensor(where, dtype=torch.long, device=self.device).T
            self.tables.index_put_(tuple(index), torch.tensor(ids, dtype=torch.long, device=self.device))

    def _fit(self, layer: int, rows: torch.Tensor, new: torch.Tensor) -> None:
        """Prefill (several tokens per request): after a layer has chosen its widths, pages for
        exactly the tokens each pool receives, `new` (B, pools), from one read of the device."""
        counts = torch.stack([self.layer_counts[layer][:, rows], new.T]).tolist()  # (count | new, pools, B)
        self.host_reads += 1
        where, ids = [], []
        for b, row in enumerate(rows.tolist()):
            rid = self._rid_of_row[row]
            for o, (pool, entry) in enumerate(zip(self.layers[layer].pools, self.requests[rid][layer])):
                entry.count = counts[0][o][b]
                self._grow_entry(layer, o, rid, pool, entry, entry.count + counts[1][o][b], where, ids)
        self._store_pages(where, ids)

    def trim(self, rids: list[int]) -> None:
        """Sync the counts of `rids` and return each pool's pages beyond room for `page_size` more
        tokens; a request's room is then what its fullest pool can still take."""
        P = self.page_size
        self.sync(rids)
        clear = []
        for rid in rids:
            row, room = self.row_of[rid], None
            for l, (layer, entries) in enumerate(zip(self.layers, self.requests[rid])):
                for o, (pool, entry) in enumerate(zip(layer.pools, entries)):
                    keep = -(-(entry.count + P) // P)
                    if len(entry.pages) > keep:
                        pool.release(entry.pages[keep:])
                        clear.extend((l, o, row, c) for c in range(keep, len(entry.pages)))
                        del entry.pages[keep:]
                    free = len(entry.pages) * P - entry.count
                    room = free if room is None else min(room, free)
            self.room[rid] = room or 0
        if clear:
            self.tables[tuple(torch.tensor(clear, dtype=torch.long, device=self.device).T)] = -1

    # -- the step's write (tensor ops only) ----------------------------------------------------------
    def write_step(self, layer: int, rows: torch.Tensor, option: torch.Tensor, positions: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None,
                   n: int = 1) -> None:
        """Append the step's tokens of B requests, n each (request-major, N = B n), to their
        request's pool of their chosen width. rows (B,) decode-state rows; option (N,) bit option;
        positions (N,); k, v (N, H_kv, d_h); valid (N,) bool, False for padding (None: every token).
        One token per request (decode): `triroute_kernels.cache_append`, into room `reserve`d in every
        pool (no read of the device). Several
        (prefill, or `valid` given): one read of the device per layer to take pages for exactly the
        tokens each pool receives, so a prompt never holds room in the pools it did not choose."""
        P, W = self.page_size, self.n_pools
        B = rows.shape[0]
        counts, tables = self.layer_counts[layer], self.layer_tables[layer]  # (pools, R), (pools, R, width)
        if n == 1 and valid is None:  # decode: each token's slot from the counts and tables, in the write's call
            cache_append(k, v, option, rows, positions, counts, tables, P, self.layers[layer].lists(), self.lost)
            return
        onehot = torch.nn.functional.one_hot(option.view(B, n), W)  # (B, n, pools)
        if valid is not None:
            onehot = onehot * valid.view(B, n, 1)
        before = (onehot.cumsum(1) - onehot).gather(-1, option.view(B, n, 1)).flatten()  # earlier same-pool tokens
        row_of_token = rows.repeat_interleave(n) if n > 1 else rows
        new = onehot.sum(1)  # (B, pools)
        self._fit(layer, rows, new)
        counts, tables = self.layer_counts[layer], self.layer_tables[layer]  # (reallocated if the prompt widened them)
        slot_index = counts[option, row_of_token] + before
        counts.index_add_(1, rows, new.T)
        page = tables[option, row_of_token, slot_index // P]
        slots = page * P + slot_index % P
        if valid is not None:
            option = torch.where(valid, option, -1)
        cache_write(k.float().contiguous(), v.float().contiguous(), option, slots, positions, self.layers[layer].lists())

    def write(self, layer: int, rids: list[int], row: torch.Tensor, option: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Host-side write of one layer (tests, benchmarks filling a cache): row (N,) index into
        `rids` (a request's tokens in increasing position), option (N,), positions (N,); k, v
        (N, H_kv, d_h), on the host or the cache's device. Writes (taking exactly the pages needed), then
        syncs the host counts."""
        B = len(rids)
        row, option, positions = row.cpu(), option.cpu(), positions.cpu()
        new = torch.bincount(row, minlength=B)
        n = int(new.max()) if row.numel() else 0
        if n == 0:
            return
        order = torch.argsort(row, stable=True)  # request by request, each in position order
        col = torch.arange(row.numel()) - torch.repeat_interleave(new.cumsum(0) - new, new)
        scatter = row[order] * n + col  # padded (B, n) flat index of each token
        padded = lambda x, fill=0: torch.full((B * n, *x.shape[1:]), fill, dtype=x.dtype,  # noqa: E731
                                              device=x.device).index_copy_(0, scatter.to(x.device), x[order.to(x.device)])
        valid = padded(torch.ones_like(row, dtype=torch.bool), False)
        self.write_step(layer, self.rows(rids), padded(option).to(self.device), padded(positions).to(self.device),
                        padded(k.to(self.device)), padded(v.to(self.device)), valid.to(self.device), n)
        self.trim(rids)

    def page_table(self, layer: int, option: int, rids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, width) page ids (padded with -1) and (B,) slot counts of pool `option`, on the cache's device."""
        rows = self.rows(rids)
        return self.tables[layer, option][rows], self.counts[layer, option][rows]

    @property
    def bytes_written(self) -> int:
        """Bytes of every token stored so far (filled slots of the live requests)."""
        return self.memory()["used"]

    # -- accounting ----------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes at rest, measured from the storage: `used` (filled slots), `slack` (unfilled
        slots of held pages), `index` (the int32 positions kept beside the codes)."""
        self.sync(list(self.requests))
        used = slack = index = 0
        for l, layer in enumerate(self.layers):
            for o, pool in enumerate(layer.pools):
                for entries in self.requests.values():
                    e = entries[l][o]
                    used += e.count * pool.slot_bytes
                    slack += (len(e.pages) * self.page_size - e.count) * pool.slot_bytes
                    index += len(e.pages) * pool.index_bytes_per_page
        return {"used": used, "slack": slack, "index": index}
