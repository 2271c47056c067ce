"""inference/audit.py: a decode step's attention counters from the cache's counts equal the ones
read from the cache's slot positions, and are taken only where every row is its request's newest
token."""

import torch

from megatron_triroute.inference.audit import newest_rows_read, slots_and_keys_read
from megatron_triroute.inference.kv_cache import PagedKVCache
from megatron_triroute.routing.modes import read_start

L, BITS, H_KV, D_HEAD, G, H, WINDOW = 3, (2, 4, 8, 16), 2, 8, 8, 4, 5
LENGTHS = (13, 1, 29)  # one request of a single token; pages of 4 cut inside every pool


def filled_cache(seed: int = 0) -> tuple[PagedKVCache, list[int]]:
    """Requests of LENGTHS tokens at every layer, each token at a random width (the host-side write)."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(L, BITS, H_KV, D_HEAD, G, page_size=4, initial_pages=1)
    rids = list(range(len(LENGTHS)))
    for rid in rids:
        cache.add_request(rid)
    row = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    for layer in range(L):
        option = torch.randint(0, len(BITS), row.shape, generator=g)
        k, v = (torch.randn(row.numel(), H_KV, D_HEAD, generator=g) for _ in range(2))
        cache.write(layer, rids, row, option, positions, k, v)
    return cache, rids


def general(cache: PagedKVCache, rows: torch.Tensor, t: torch.Tensor, lo: torch.Tensor):
    requests, request = torch.unique(rows, return_inverse=True)
    return slots_and_keys_read([[p.token_pos for p in cache.layers[y].pools] for y in range(L)],
                               torch.stack([cache.layer_tables[y][:, requests] for y in range(L)]), request, lo, t)


def test_newest_rows_equal_the_slot_positions_count_for_every_mode():
    cache, rids = filled_cache()
    rows, t = cache.rows(rids), torch.tensor(LENGTHS) - 1  # each request's newest token
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        mode = torch.randint(0, 3, (L, len(rids), H), generator=g)  # skip, local, full per (layer, row, head)
        lo = read_start(t.view(1, -1, 1), mode, WINDOW)
        fast = newest_rows_read(cache, list(range(L)), rows, t, lo)
        assert fast is not None
        slots, keys = general(cache, rows, t, lo)
        assert torch.equal(fast[0], slots) and torch.equal(fast[1], keys)
        # by hand: every request's whole context, and per (row, head) the keys its mode reaches
        reach = torch.where(mode == 0, 0, torch.where(mode == 1, (t.view(1, -1, 1) + 1).clamp(max=WINDOW + 1),
                                                     t.view(1, -1, 1) + 1))
        assert torch.equal(fast[1], reach.sum((1, 2)))
        assert torch.equal(fast[0].sum(1), torch.full((L,), sum(LENGTHS)))


def test_rows_that_are_not_their_requests_newest_take_the_slot_positions_count():
    cache, rids = filled_cache()
    rows, t = cache.rows(rids), torch.tensor(LENGTHS) - 1
    lo = read_start(t.view(1, -1, 1), torch.full((L, len(rids), H), 2), WINDOW)
    # a prefill's earlier row: its request holds slots past its position
    earlier = t.clone()
    earlier[0] -= 3
    assert newest_rows_read(cache, list(range(L)), rows, earlier, lo) is None
    # a request seen twice (two rows of one prompt)
    twice = torch.cat([rows, rows[:1]])
    t2 = torch.cat([t, t[:1] - 1])
    lo2 = read_start(t2.view(1, -1, 1), torch.full((L, len(twice), H), 2), WINDOW)
    assert newest_rows_read(cache, list(range(L)), twice, t2, lo2) is None
    # one layer of the cache on its own takes the counts of that layer
    one = newest_rows_read(cache, [1], rows, t, lo[1:2])
    slots, keys = general(cache, rows, t, lo)
    assert torch.equal(one[0], slots[1:2]) and torch.equal(one[1], keys[1:2])
