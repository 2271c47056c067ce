"""The paged cache stores exactly what training writes: bytes equal to `tests.oracles.pack_kv` of
one (token, head), dequantised values bit-identical to `quant.fake_quantize` (16 bits: the float16
value `pack_kv` stores), bytes at rest equal to the sum of `kv_bits_per_token / 8`, and freed
pages are reused."""

import torch

from megatron_triroute.inference.kv_cache import PagedKVCache
from megatron_triroute.routing.quant import fake_quantize, kv_bits_per_token
from tests.oracles import pack_kv

BITS = (2, 4, 8, 16)


def _filled(n_tokens=11, n_kv=2, d=16, g=8, page=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(n_layers=1, bits=BITS, n_kv_heads=n_kv, d_head=d, group_size=g, page_size=page, initial_pages=1)
    cache.add_request(7)
    cache.add_request(9)
    k = torch.randn(2, n_tokens, n_kv, d, generator=gen) * 3
    v = torch.randn(2, n_tokens, n_kv, d, generator=gen)
    k[0, 3, 1, :g] = 0.5  # a constant group: scale 0, dequantises to its zero exactly
    option = torch.randint(0, len(BITS), (2, n_tokens), generator=gen)
    pos = torch.arange(n_tokens).expand(2, n_tokens)
    row = torch.arange(2).view(2, 1).expand(2, n_tokens)
    # Two writes (a prefill then a decode step) for both requests.
    for sl in (slice(0, n_tokens - 1), slice(n_tokens - 1, n_tokens)):
        cache.write(0, [7, 9], row[:, sl].flatten(), option[:, sl].flatten(), pos[:, sl].flatten(),
                    k[:, sl].flatten(0, 1), v[:, sl].flatten(0, 1))
    return cache, k, v, option, (n_kv, d, g)


def test_pages_dequantise_bit_identically_and_hold_pack_kv_bytes():
    cache, k, v, option, (n_kv, d, g) = _filled()
    seen = 0
    for o, bits in enumerate(BITS):
        pool = cache.layers[0].pools[o]
        table, counts = cache.page_table(0, o, [7, 9])
        K, V, pos = pool.read(table)  # (B, pages, P, H_kv, d)
        K, V, pos = K.flatten(1, 2), V.flatten(1, 2), pos.flatten(1, 2)
        for b in range(2):
            expect_pos = (option[b] == o).nonzero().flatten()
            n = int(counts[b])
            assert n == expect_pos.numel()
            assert torch.equal(pos[b, :n], expect_pos)
            for x, got in ((k[b, expect_pos], K[b, :n]), (v[b, expect_pos], V[b, :n])):
                want = fake_quantize(x, bits, g) if bits < 16 else x.half().float()
                assert torch.equal(got, want), (bits, (got - want).abs().max())
            seen += n
            if bits < 16 and n:  # the stored bytes of one (token, head) are pack_kv's
                t, h = 0, 1
                packed = pack_kv(k[b, expect_pos[t]][h].view(1, 1, d), bits, g)
                entry = cache.requests[[7, 9][b]][0][o]
                page, slot = entry.pages[t // cache.page_size], t % cache.page_size
                assert torch.equal(pool.k.codes[page, slot, h], packed.codes)
                assert torch.equal(pool.k.scale[page, slot, h], packed.scale.flatten())
                assert torch.equal(pool.k.zero[page, slot, h], packed.zero.flatten())
    assert seen == option.numel()


def test_bytes_at_rest_equal_the_cost_models_bits():
    cache, _, _, option, (n_kv, d, g) = _filled()
    expected_bits = sum(kv_bits_per_token(BITS[o], n_kv * d, g) for o in option.flatten().tolist())
    mem = cache.memory()
    assert mem["used"] * 8 == expected_bits
    assert cache.bytes_written * 8 == expected_bits
    pages = sum(len(e.pages) for entries in cache.requests.values() for e in entries[0])
    page_bytes = sum(len(e.pages) * cache.layers[0].pools[o].page_bytes
                     for entries in cache.requests.values() for o, e in enumerate(entries[0]))
    assert mem["used"] + mem["slack"] == page_bytes and pages > 0
    assert mem["index"] == pages * cache.page_size * 4  # one int32 position per slot


def test_freed_pages_are_reused():
    cache, k, v, option, _ = _filled()
    held = {o: sorted(p for e in (cache.requests[7][0][o],) for p in e.pages) for o in range(len(BITS))}
    sizes = [pool.num_pages for pool in cache.layers[0].pools]
    cache.free_request(7)
    for o, pool in enumerate(cache.layers[0].pools):  # freed slots hold no position a read could match
        assert bool((pool.token_pos[held[o]] == -1).all()) if held[o] else True
    cache.add_request(11)
    n = option.shape[1]
    cache.write(0, [11], torch.zeros(n, dtype=torch.long), option[0], torch.arange(n), k[0], v[0])
    for o, pool in enumerate(cache.layers[0].pools):
        pages = cache.requests[11][0][o].pages
        assert set(held[o]) <= set(pages)  # the freed pages, taken back from the free list
        # Room for one page of further tokens at most: a free list that held enough means no growth.
        assert len(pages) <= -(-(cache.requests[11][0][o].count + cache.page_size) // cache.page_size)
        assert pool.num_pages <= sizes[o] + max(0, len(pages) - len(held[o]))
