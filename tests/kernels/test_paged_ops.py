"""The one-call decode ops (`paged_ops`): the C++ CPU kernels against the naive reference, the
PyTorch twins and the cache's number format; the fallback when the kernels are unavailable."""

import dataclasses
import math
import statistics
import time
import types

import pytest
import torch

import triroute_kernels.paged_ops as paged_ops
from tests.kernels.scenario import fill_pools, mixed_pools, naive_attention
from tests.oracles import hard_experts, pack_kv, swiglu
from triroute_kernels import allocate_kv_pools, cpu_ops_available, quantize_pack_into_torch
from triroute_kernels import cpu_ops
from triroute_kernels.paged_ops import (
    DECODE_LINEAR_ROWS,
    cache_append,
    cache_write,
    cache_write_torch,
    decode_linear,
    paged_attention,
    paged_attention_torch,
    routed_experts,
    routed_experts_torch,
)
from triroute_kernels.quant import pack_codes, quantize_groups



def test_the_cpp_kernels_build_here():
    """The install provides g++ and ninja: a failed build is a failure here, not a skip."""
    assert cpu_ops_available(), cpu_ops.cpu_ops_error()

WIDTHS = (2, 4, 8, 16)
D, GS = 16, 8


def _mixed_pools(lengths, H_kv, P, gen, d=D, gs=GS):
    return mixed_pools(lengths, H_kv, P, gen, WIDTHS, d, gs)


def _rows_reference(q, stores, request, lo, hi, sm, gs=GS):
    """naive_attention with each query row reading its own request's tokens."""
    rows = [dataclasses.replace(s, tokens=[s.tokens[int(r)] for r in request]) for s in stores]
    return naive_attention(q, rows, gs, lo, hi, sm)[0]


@pytest.mark.parametrize("H_kv", [1, 2, 4])
@pytest.mark.parametrize("P", [4, 16])
@pytest.mark.parametrize("d, gs", [(D, GS), (64, 32), (128, 32), (32, 32), (12, 4)],
                         ids=["d16", "d64", "d128", "d32", "d12-scalar"])
@pytest.mark.parametrize("threads", [1, 2], ids=["one-thread", "two-threads"])
def test_paged_attention_matches_reference_and_twin(H_kv, P, d, gs, threads):
    """d 64 runs the kernel's widest register blocks (P·V over 64 channels with AVX-512, 32 with
    AVX2) and, with groups of 32, its 16-lane unpacking on AVX-512; d 32, 64 and 128 with groups of
    32 the unpacking and scores compiled for those shapes; d 16 its 16-lane scores (AVX-512) and
    8-channel loops; d 12 with groups of 4 its scalar loops (those of a build without AVX2). On one
    thread every (row chunk, KV head) item runs whole; on two, with fewer than four items a thread
    (five row chunks, one KV head), the items' pages are split among units (split-K)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _matches_reference_and_twin(H_kv, P, d, gs)
    finally:
        torch.set_num_threads(before)


def _matches_reference_and_twin(H_kv, P, d, gs):
    gen = torch.Generator().manual_seed(100 * H_kv + P)
    H = 4
    lengths = [37, 9, 1, 20]  # requests of different lengths in one batch; partial last pages
    stores, tables = _mixed_pools(lengths, H_kv, P, gen, d, gs)
    # decode rows (one per request, at its last position) then prefill rows of request 0 at several hi
    request = torch.tensor([0, 1, 2, 3, 0, 0, 0, 0], dtype=torch.long)
    hi = torch.tensor([36, 8, 0, 19, 0, 5, 17, 30], dtype=torch.long)
    N = len(request)
    # per head: full (lo 0), local windows of 1 and 7 keys, skip (lo > hi); heads of one group differ
    modes = torch.randint(0, 4, (N, H), generator=gen)
    window = torch.tensor([0, 0, 6, 0])[modes]
    lo = torch.where(modes == 0, 0, (hi.view(N, 1) - window).clamp_min(0))
    lo = torch.where(modes == 3, hi.view(N, 1) + 1, lo)
    lo[0, 0], lo[1, H - 1], lo[2, 0] = 0, hi[1] + 1, 0  # at least one full head and one skip
    q = torch.randn(N, H, d, generator=gen)
    sm = 1 / math.sqrt(d)
    k_pools = [s.k_pool for s in stores]
    v_pools = [s.v_pool for s in stores]
    counters = torch.zeros(2, dtype=torch.long)
    out = paged_attention(q, (k_pools, v_pools), tables, request, lo, hi, sm, counters)
    ref = _rows_reference(q, stores, request, lo, hi, sm, gs)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()
    twin_counters = torch.zeros(2, dtype=torch.long)
    twin = paged_attention_torch(q, k_pools, v_pools, tables, request, lo, hi, sm, twin_counters)
    assert torch.allclose(out, twin, atol=1e-5, rtol=1e-5)
    assert torch.equal(counters, twin_counters) and counters[0] > 0
    skipped = lo > hi.view(N, 1)
    assert skipped.any() and not out[skipped].any()


@pytest.mark.parametrize("threads", [1, 16], ids=["one-thread", "split-K"])
@pytest.mark.parametrize("page_order", ["written", "reversed"])
def test_keys_in_many_blocks_and_pages_out_of_position_order(page_order, threads):
    """The kernel softmaxes one block of pages at a time (up to 64 keys at d 64): a long request
    spans many blocks; prefill rows end mid-block, local windows start mid-block. A page table that
    lists pages against position order (reversed) ends a block at every page, and must read the
    same keys. With more threads than (row chunk, KV head) items, each item's pages are split
    among several units whose softmax states are merged (split-K): the same output and counters."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _keys_in_many_blocks(page_order)
    finally:
        torch.set_num_threads(before)


def _keys_in_many_blocks(page_order):
    gen = torch.Generator().manual_seed(23)
    d, gs, H, H_kv, P = 64, 32, 4, 2, 16
    stores, tables = _mixed_pools([700, 150], H_kv, P, gen, d, gs)  # ~175 keys of request 0 in each pool
    if page_order == "reversed":
        for w in range(tables.shape[0]):
            for b in range(tables.shape[1]):
                used = int((tables[w, b] >= 0).sum())
                tables[w, b, :used] = tables[w, b, :used].flip(0)
    request = torch.tensor([0, 1, 0, 0, 0, 1], dtype=torch.long)
    hi = torch.tensor([699, 149, 63, 64, 400, 149], dtype=torch.long)
    N = len(request)
    window = torch.tensor([[0, 100, 5, 0], [0, 0, 70, 149], [0, 1, 63, 0], [0, 64, 0, 3], [0, 200, 130, 0],
                           [0, 0, 0, 0]])
    lo = (hi.view(N, 1) - window).clamp_min(0)
    lo[:, 0] = 0  # one full head per row
    lo[-1] = hi[-1] + 1  # but the last: every head skips (a chunk, and its split parts, that read nothing)
    q = torch.randn(N, H, d, generator=gen)
    counters, twin_counters = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    out = paged_attention(q, ([s.k_pool for s in stores], [s.v_pool for s in stores]), tables, request, lo, hi, 0.125,
                          counters)
    ref = _rows_reference(q, stores, request, lo, hi, 0.125, gs)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()
    twin = paged_attention_torch(q, [s.k_pool for s in stores], [s.v_pool for s in stores], tables, request, lo, hi,
                                 0.125, twin_counters)
    assert torch.allclose(out, twin, atol=1e-5, rtol=1e-5)
    assert torch.equal(counters, twin_counters)
    assert counters[0] == 2 * d * int((hi.view(N, 1) - lo + 1).sum())  # every head its own keys, once
    assert not out[-1].any()


@pytest.mark.parametrize("H_kv", [1, 2])
@pytest.mark.parametrize("d, gs", [(64, 32), (32, 16), (16, 8)], ids=["d64", "d32", "d16"])
def test_heads_that_read_the_same_keys_accumulate_together(H_kv, d, gs):
    """The kernel accumulates P.V for up to four heads of a row that read the same keys of a block
    at once. Twelve query heads: six full, three of one window, two of another, a skip. In one group
    of 12 the full heads make a set of four, then a set of two across the skip; in two groups of 6,
    sets of four and two, the windows' sets of two, two and one. Decode rows and prefill rows of one
    chunk. Each head's output is its own (reference and twin); d 64 and 32 with groups of 32 and 16
    also take the unpacking by table lookup of the 2- and 4-bit pools."""
    gen = torch.Generator().manual_seed(7 * d + H_kv)
    H = 12
    stores, tables = _mixed_pools([90, 33], H_kv, 16, gen, d, gs)
    request = torch.tensor([0, 1, 0, 0, 0], dtype=torch.long)
    hi = torch.tensor([89, 32, 70, 71, 40], dtype=torch.long)
    N = len(request)
    window = torch.tensor([0, 0, 9, 0, 0, 9, 0, 30, 9, 30, -1, 0])  # 0 full, -1 skip
    lo = (hi.view(N, 1) - window).clamp_min(0)
    lo = torch.where(window == 0, 0, lo)
    lo = torch.where(window < 0, hi.view(N, 1) + 1, lo)
    q = torch.randn(N, H, d, generator=gen)
    sm = 1 / math.sqrt(d)
    k_pools, v_pools = [s.k_pool for s in stores], [s.v_pool for s in stores]
    counters, twin_counters = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    out = paged_attention(q, (k_pools, v_pools), tables, request, lo, hi, sm, counters)
    ref = _rows_reference(q, stores, request, lo, hi, sm, gs)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()
    twin = paged_attention_torch(q, k_pools, v_pools, tables, request, lo, hi, sm, twin_counters)
    assert torch.allclose(out, twin, atol=1e-5, rtol=1e-5)
    assert torch.equal(counters, twin_counters)
    assert not out[:, 10].any() and out[:, 11].abs().sum(-1).gt(0).all()


@pytest.mark.parametrize("d", [64, 128])
def test_a_decode_row_alone_equals_the_same_row_in_a_chunk_bit_for_bit(d):
    """A chunk of one query row (a decode step's) takes the kernel's register loops on AVX-512: each
    K and V row dequantised into registers for the heads that read it. A chunk of several rows of
    one request dequantises each row into a buffer they share. The same values, scores and sums in
    the same order either way: a row alone and the same row twice in one chunk give the same bits,
    over every width, blocks of many pages, full heads in sets of four and one, windows that start
    inside a set of eight keys, and a skipped head (on a build without AVX-512 both take the buffer)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(d)
        H, H_kv, P = 12, 2, 16
        stores, tables = _mixed_pools([700, 150], H_kv, P, gen, d, 32)
        window = torch.tensor([0, 0, 0, 0, 0, 100, 5, 37, -1, 37, 0, 3])  # 0 full, -1 skip
        hi = torch.tensor([699])
        lo = torch.where(window == 0, 0, (hi - window).clamp_min(0)).view(1, H)
        lo = torch.where(window.view(1, H) < 0, hi + 1, lo)
        q = torch.randn(1, H, d, generator=gen)
        pools = ([s.k_pool for s in stores], [s.v_pool for s in stores])
        one, two = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)
        alone = paged_attention(q, pools, tables, torch.tensor([0]), lo, hi, 1 / math.sqrt(d), one)
        chunk = paged_attention(q.expand(2, H, d).contiguous(), pools, tables, torch.tensor([0, 0]), lo.expand(2, H),
                                hi.expand(2), 1 / math.sqrt(d), two)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone[0], chunk[0]) and torch.equal(chunk[0], chunk[1])
    assert torch.equal(2 * one, two) and one[0] > 0
    ref = _rows_reference(q, stores, torch.tensor([0]), lo, hi, 1 / math.sqrt(d), 32)
    assert torch.allclose(alone, ref, atol=1e-5, rtol=1e-5), (alone - ref).abs().max()
    assert not alone[0, 8].any() and alone[0, 9].abs().sum() > 0


def test_a_local_head_reads_only_its_window_and_counters_count_it():
    """Hand count: one local head of window w reads w + 1 keys (the pages before are skipped
    whole); a full head of the same group reads everything."""
    gen = torch.Generator().manual_seed(5)
    st = fill_pools(quantize_pack_into_torch, 4, [list(range(203))], 1, D, GS, 4, gen)
    tables = st.page_table.long().unsqueeze(0)
    q = torch.randn(1, 2, D, generator=gen)
    hi = torch.tensor([202])
    row_bytes = 2 * (D * 4 // 8 + 2 * 2 * (D // GS))  # K + V: codes + f16 scale + f16 zero
    for lo, keys, rows, broken in (([195, 0], 8 + 203, 203, 0), ([203, 203], 0, 0, 0), ([195, 203], 8, 8, 48)):
        for pool in (st.k_pool, st.v_pool):  # pages wholly before the window must not be read
            pool.scale[tables[0, 0, :broken]] = float("nan")
        counters = torch.zeros(2, dtype=torch.long)
        out = paged_attention(q, ([st.k_pool], [st.v_pool]), tables, torch.tensor([0]), torch.tensor([lo]), hi, 0.25, counters)
        assert counters.tolist() == [2 * D * keys, row_bytes * rows]
        assert torch.allclose(out, _rows_reference(q, [st], [0], torch.tensor([lo]), hi, 0.25), atol=1e-5)


def _halfway_data(N, H_kv, gen):
    """Random K/V with constant groups and values exactly half-way between two codes."""
    x = torch.randn(N, H_kv, D, generator=gen) * 3
    x[0, 0, :GS] = 0.75  # constant group: scale 0, codes 0
    x[1, 0, :GS] = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.0, 1.0, 2.0, 3.0])  # 2 bits: s = 1, ties to even
    x[2, 0, :GS] = torch.tensor([0.0, 7.5, 8.5, 0.5, 1.5, 14.5, 15.0, 2.5])  # 4 bits: s = 1
    x[3, 0, :GS] = torch.tensor([0.0, 255.0, 0.5, 1.5, 2.5, 100.5, 101.5, 254.5])  # 8 bits: s = 1
    # ranges whose scale max / levels rounds to another float16 when computed as max * (1 / levels)
    x[4, 0, :GS] = torch.tensor([0.0, 6.524413585662842, 1, 2, 3, 4, 5, 6])  # 2 bits
    x[5, 0, :GS] = torch.tensor([0.0, 5.4144287109375, 1, 2, 3, 4, 5, 0.5])  # 4 bits
    x[6, 0, :GS] = torch.tensor([0.0, 5.332603454589844, 1, 2, 3, 4, 5, 0.5])  # 8 bits
    return x


def _fresh_pools(H_kv, P, pages):
    pools = [allocate_kv_pools(b, pages, P, H_kv, D, GS) for b in WIDTHS]
    return [k for k, _ in pools], [v for _, v in pools]


def test_cache_write_stores_a_nan_group_as_nan_as_the_twin_does():
    """A NaN in a K or V group (first, middle or last channel) gives that group NaN scale and zero at
    every quantised width, as the twin's minimum and maximum do: a corrupt value never passes as a
    stored number. The C++ kernel's vector and scalar min/max drop a NaN unless it is looked for."""
    gen = torch.Generator().manual_seed(12)
    H_kv, P, pages, N = 1, 4, 2, 8
    k, v = torch.randn(N, H_kv, D, generator=gen), torch.randn(N, H_kv, D, generator=gen)
    k[0, 0, 0] = k[1, 0, 3] = k[2, 0, D - 1] = float("nan")
    v[3, 0, GS - 1] = v[4, 0, 1] = v[5, 0, D - 2] = float("nan")
    option = torch.arange(N) % len(WIDTHS)
    slots, positions = torch.arange(N) // len(WIDTHS), torch.arange(N)
    got_k, got_v = _fresh_pools(H_kv, P, pages)
    cache_write(k, v, option, slots, positions, (got_k, got_v))
    twin_k, twin_v = _fresh_pools(H_kv, P, pages)
    cache_write_torch(k, v, option, slots, positions, twin_k, twin_v)
    nan_scales = 0
    for a, b in zip(got_k + got_v, twin_k + twin_v):
        for ta, tb in zip(a.storage_tensors(), b.storage_tensors()):
            if ta.is_floating_point():
                assert torch.equal(ta.isnan(), tb.isnan()), f"{a.bits}-bit pool's NaNs differ"
                ta, tb = ta.nan_to_num(), tb.nan_to_num()
                nan_scales += int(a.bits < 16 and b.storage_tensors()[1].isnan().any())
            assert torch.equal(ta, tb), f"{a.bits}-bit pool differs"
    assert nan_scales > 0  # the NaNs reached quantised pools


def test_cache_write_is_bit_exact_with_the_number_format():
    gen = torch.Generator().manual_seed(11)
    H_kv, P, pages, N = 2, 4, 6, 40
    k = _halfway_data(N, H_kv, gen)
    v = _halfway_data(N, H_kv, gen).flip(0)
    option = torch.randint(-1, len(WIDTHS), (N,), generator=gen)
    option[:7] = torch.tensor([0, 0, 1, 2, 0, 1, 2])  # the hand-made groups land at their width
    option[7:11] = torch.arange(4)  # every pool is written
    slots = torch.empty(N, dtype=torch.long)
    for w in range(len(WIDTHS)):  # distinct slots per pool
        sel = (option == w).nonzero().flatten()
        slots[sel] = torch.randperm(pages * P, generator=gen)[: sel.numel()]
    slots[option < 0] = 10**9  # a skipped token's slot is never looked at
    positions = torch.randint(0, 1000, (N,), generator=gen)
    got_k, got_v = _fresh_pools(H_kv, P, pages)
    cache_write(k, v, option, slots, positions, (got_k, got_v))
    twin_k, twin_v = _fresh_pools(H_kv, P, pages)
    cache_write_torch(k, v, option, slots.clamp_max(pages * P - 1), positions, twin_k, twin_v)
    for a, b in zip(got_k + got_v, twin_k + twin_v):
        assert torch.equal(a.token_pos, b.token_pos)
        for ta, tb in zip(a.storage_tensors(), b.storage_tensors()):
            assert torch.equal(ta, tb), f"{a.bits}-bit pool differs"
    # and against quant.quantize_groups + pack_codes directly, token by token
    for n in range(N):
        w = int(option[n])
        if w < 0:
            continue
        for x, pool in ((k, got_k[w]), (v, got_v[w])):
            s = int(slots[n])
            page, off = divmod(s, P)
            assert int(pool.token_pos[page, off]) == int(positions[n])
            if pool.bits == 16:
                assert torch.equal(pool.values[page, off], x[n].half())
                continue
            codes, scale, zero = quantize_groups(x[n], pool.bits, GS)
            assert torch.equal(pool.codes[page, off], pack_codes(codes.flatten(-2), pool.bits))
            assert torch.equal(pool.scale[page, off], scale) and torch.equal(pool.zero[page, off], zero)
            assert torch.equal(pool.codes[page, off], torch.stack([pack_kv(x[n, h : h + 1], pool.bits, GS).codes for h in range(H_kv)]))
    # the half-way groups: ties went to even codes (2 bits: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2)
    p0 = got_k[0]
    page, off = divmod(int(slots[1]), P)
    first = int(p0.codes[page, off, 0, 0])
    assert [(first >> (2 * i)) & 3 for i in range(4)] == [0, 0, 2, 2]


def _decode_state(R, pages, P, width, gen):
    """counts (pools, R) below each row's reserved room and tables (pools, R, width): each row's
    pages in a pool distinct, some columns unreserved (-1)."""
    W = len(WIDTHS)
    tables = torch.full((W, R, width), -1, dtype=torch.long)
    counts = torch.zeros(W, R, dtype=torch.long)
    for w in range(W):
        free = torch.randperm(pages, generator=gen).tolist()
        for r in range(R):
            held = int(torch.randint(1, width + 1, (), generator=gen))
            tables[w, r, :held] = torch.tensor([free.pop() for _ in range(held)])
            counts[w, r] = int(torch.randint(0, held * P, (), generator=gen))  # the next slot is on a held page
    return counts, tables


def test_cache_append_takes_each_tokens_next_slot_as_the_tensor_ops_do(monkeypatch):
    """A decode step's append (C++): each token's slot from its pool's count and page table, the
    counts advanced, the pools written bit for bit as the tensor ops and the twin write them; the
    slot holds the token's position."""
    from benchmarks.op_counter import StepCounter

    gen = torch.Generator().manual_seed(21)
    H_kv, P, R, width = 2, 4, 6, 3
    pages = R * width + 2
    counts, tables = _decode_state(R, pages, P, width, gen)
    rows = torch.tensor([4, 0, 5, 2])  # distinct, any order
    option = torch.tensor([0, 3, 1, 3])
    k, v = torch.randn(4, H_kv, D, generator=gen) * 2, torch.randn(4, H_kv, D, generator=gen)
    positions = torch.tensor([7, 100, 3, 42])
    index = counts[option, rows].clone()
    want_slots = tables[option, rows, index // P] * P + index % P
    results = []
    for use_cpp in (True, False):
        if not use_cpp:
            monkeypatch.setattr(paged_ops, "cpu_ops_available", lambda: False)
        c, pools = counts.clone(), _fresh_pools(H_kv, P, pages)
        with StepCounter() as counter:
            cache_append(k, v, option, rows, positions, c, tables, P, pools)
        assert ("triroute.cache_append" in counter.foreign_ops) == use_cpp, counter.foreign_ops
        results.append((c, pools))
    expected = counts.clone()
    expected[option, rows] += 1
    reference = _fresh_pools(H_kv, P, pages)
    cache_write_torch(k, v, option, want_slots, positions, *reference)
    for c, pools in results:
        assert torch.equal(c, expected)
        for a, b in zip(pools[0] + pools[1], reference[0] + reference[1]):
            assert torch.equal(a.token_pos, b.token_pos)
            assert all(torch.equal(ta, tb) for ta, tb in zip(a.storage_tensors(), b.storage_tensors())), a.bits
    for n in range(4):
        page, off = divmod(int(want_slots[n]), P)
        assert int(results[0][1][0][int(option[n])].token_pos[page, off]) == int(positions[n])


def test_cache_append_without_a_reserved_page_says_so_and_changes_nothing():
    gen = torch.Generator().manual_seed(22)
    P, R, width = 4, 3, 2
    counts, tables = _decode_state(R, 8, P, width, gen)
    tables[1, 2, :] = -1
    counts[1, 2] = 0  # row 2 holds no page in pool 1
    counts[2, 0] = width * P  # row 0's pool 2 is full: its next slot is past the table
    pools = _fresh_pools(1, P, 8)
    for option, rows in ((torch.tensor([0, 1]), torch.tensor([0, 2])), (torch.tensor([2]), torch.tensor([0]))):
        before = counts.clone()
        k = torch.randn(option.numel(), 1, D, generator=gen)
        with pytest.raises(RuntimeError, match="no page reserved.*reserve room"):
            cache_append(k, k, option, rows, torch.arange(option.numel()), counts, tables, P, pools)
        assert torch.equal(counts, before)
        assert all((p.token_pos == -1).all() for p in pools[0])  # nothing written


def test_routed_experts_equals_a_loop_over_experts():
    gen = torch.Generator().manual_seed(3)
    N, Dm, F_, E, k = 9, 24, 40, 5, 2
    x = torch.randn(N, Dm, generator=gen)
    w1 = [torch.randn(F_, Dm, generator=gen) * 0.2 for _ in range(E)]
    w3 = [torch.randn(F_, Dm, generator=gen) * 0.2 for _ in range(E)]
    w2 = [torch.randn(Dm, F_, generator=gen) * 0.2 for _ in range(E)]
    index = torch.randint(-1, E - 1, (N, k), generator=gen)  # expert E-1 unused; -1 = null expert
    index[0] = torch.tensor([-1, -1])  # a token that runs no expert
    weight = torch.rand(N, k, generator=gen)
    out = routed_experts(x, index, weight, w1, w3, w2)
    ref = hard_experts(x, index, weight, [swiglu(a.T, b.T, c.T) for a, b, c in zip(w1, w3, w2)])
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(out, routed_experts_torch(x, index, weight, w1, w3, w2), atol=1e-5)
    assert not out[0].any()
    # only chosen experts are read: a broken unused expert changes nothing
    w1[E - 1] = torch.full_like(w1[E - 1], float("nan"))
    assert torch.equal(routed_experts(x, index, weight, w1, w3, w2), out)


@pytest.mark.parametrize("N", [1, 2, 9])
def test_static_routed_experts_equal_the_loop_and_read_nothing_back(N):
    """A GPU's form (stacked weights, shapes fixed by N, k and E): the routes' own weights gathered
    (N k <= E) or every expert over every token with dense gates; equal to the loop twin, the null
    expert adding nothing, no host read, and under the Triton backend what `routed_experts` takes."""
    from benchmarks.op_counter import StepCounter

    gen = torch.Generator().manual_seed(30 + N)
    Dm, F_, E, k = 24, 40, 5, 2
    x = torch.randn(N, Dm, generator=gen)
    w1, w3 = (torch.randn(E, F_, Dm, generator=gen) * 0.2 for _ in range(2))
    w2 = torch.randn(E, Dm, F_, generator=gen) * 0.2
    index = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    index[0, 1] = -1  # a null route
    index[-1] = torch.tensor([0, -1])  # a real route to expert 0, then a null one (which reads expert 0)
    weight = torch.rand(N, k, generator=gen)
    want = routed_experts_torch(x, index, weight, w1, w3, w2)
    with StepCounter() as counter:
        got = paged_ops.routed_experts_static(x, index, weight, w1, w3, w2)
    assert counter.syncs == {}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not got[0, :].isnan().any()
    # an expert no token routes to changes nothing, in either form
    unused = sorted(set(range(E)) - set(index.flatten().tolist()))
    if unused:
        w1[unused[0]] = float("nan")
        torch.testing.assert_close(paged_ops.routed_experts_static(x, index, weight, w1, w3, w2), got, rtol=0, atol=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRIROUTE_KERNELS", "triton")
        mp.setattr(paged_ops, "cpu_ops_available", lambda: False)
        mp.setattr(paged_ops, "routed_experts_static", lambda *a: "static")
        assert routed_experts(x, index, weight, w1, w3, w2) == "static"


@pytest.mark.parametrize("M,N,K", [(1, 50, 64), (2, 17, 24), (3, 8, 8), (8, 33, 100), (DECODE_LINEAR_ROWS, 9, 12),
                                   (1, 7, 5), (DECODE_LINEAR_ROWS + 1, 16, 16)])
def test_decode_linear_equals_a_float64_matmul(M, N, K):
    """Rows of w in blocks of 8 and the rows after the last block; K with and without a tail past
    a multiple of 8; more rows of x than the kernel takes (F.linear then)."""
    gen = torch.Generator().manual_seed(M * 1000 + N)
    x, w = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen)
    y = decode_linear(x, w)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert torch.allclose(y.double(), x.double() @ w.double().T, atol=1e-5 * math.sqrt(K), rtol=0)
    if M <= DECODE_LINEAR_ROWS:  # the kernel itself ran, not the fallback
        assert torch.equal(torch.ops.triroute.decode_linear(x, w), y)
    # a transposed (non-contiguous) weight is served too, and equals the contiguous one
    wt = w.T.contiguous().T
    assert torch.allclose(decode_linear(x, wt), y, atol=1e-5 * math.sqrt(K))


@pytest.mark.parametrize("M,N,K", [(5, 19, 24), (2, 40, 64), (3, 16, 32), (4, 33, 48), (7, 24, 80), (DECODE_LINEAR_ROWS, 17, 16)])
def test_decode_linear_reads_every_row_of_x_against_its_own_output(M, N, K):
    """Row m of the result depends on row m of x only (a swapped or reused x row would show), and,
    where the kernel's own loops run (a native build on a CPU with AVX2), has the same bits as row m
    alone: several rows of x at once (K a multiple of 16 with AVX-512: up to four through the block
    read row after row, more three at a time) sum each product as one row does. (Elsewhere BLAS
    serves both, whose one-row and several-row paths may round differently.)"""
    import os

    gen = torch.Generator().manual_seed(9 + M)
    x, w = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen)
    y = decode_linear(x, w)
    own_loops = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and not os.environ.get("TRIROUTE_CPU_OPS_PORTABLE")
    for m in range(M):
        alone = decode_linear(x[m : m + 1], w)[0]
        assert torch.equal(alone, y[m]) if own_loops else torch.allclose(alone, y[m], atol=1e-5 * math.sqrt(K), rtol=0), m
    x2 = x.clone()
    x2[M // 2] = 0
    y2 = decode_linear(x2, w)
    assert torch.equal(y2[: M // 2], y[: M // 2]) and torch.equal(y2[M // 2 + 1 :], y[M // 2 + 1 :])
    assert not y2[M // 2].any()


def test_without_the_cpp_kernels_the_api_falls_back_to_the_twins(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    stores, tables = _mixed_pools([12, 5], 2, 4, gen)
    k_pools, v_pools = [s.k_pool for s in stores], [s.v_pool for s in stores]
    q = torch.randn(2, 4, D, generator=gen)
    args = (tables, torch.tensor([0, 1]), torch.zeros(2, 4, dtype=torch.long), torch.tensor([11, 4]), 0.25)
    fast = paged_attention(q, (k_pools, v_pools), *args)
    calls = []
    monkeypatch.setattr(paged_ops, "cpu_ops_available", lambda: False)
    monkeypatch.setattr(torch.ops.triroute, "paged_attention", lambda *a: calls.append(a))
    slow = paged_attention(q, (k_pools, v_pools), *args)
    assert not calls and torch.allclose(fast, slow, atol=1e-5)
    x = torch.randn(3, 2, D, generator=gen)
    pools_twin = _fresh_pools(2, 4, 2)
    cache_write(x, -x, torch.tensor([0, 3, 1]), torch.tensor([1, 2, 7]), torch.tensor([4, 5, 6]), pools_twin)
    w = [torch.randn(6, 8, generator=gen)]
    y = torch.randn(2, 8, generator=gen)
    experts_twin = routed_experts(y, torch.tensor([[0], [-1]]), torch.ones(2, 1), w, w, [torch.randn(8, 6, generator=gen)])
    linear_twin = decode_linear(y, w[0])
    monkeypatch.undo()
    assert torch.allclose(linear_twin, decode_linear(y, w[0]), atol=1e-5)
    pools_cpp = _fresh_pools(2, 4, 2)
    cache_write(x, -x, torch.tensor([0, 3, 1]), torch.tensor([1, 2, 7]), torch.tensor([4, 5, 6]), pools_cpp)
    for a, b in zip(pools_twin[0] + pools_twin[1], pools_cpp[0] + pools_cpp[1]):
        assert all(torch.equal(ta, tb) for ta, tb in zip(a.storage_tensors() + [a.token_pos], b.storage_tensors() + [b.token_pos]))
    assert not experts_twin[1].any() and experts_twin[0].any()
    monkeypatch.setattr(paged_ops, "cpu_ops_available", lambda: False)
    # a failed build is reported, not raised
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setenv("TRIROUTE_NO_CPU_OPS", "1")
    assert cpu_ops.cpu_ops_available() is False and "TRIROUTE_NO_CPU_OPS" in cpu_ops.cpu_ops_error()
    # a module without its C++ source beside it (an exported model's code) says so
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.delenv("TRIROUTE_NO_CPU_OPS")
    monkeypatch.setattr(cpu_ops, "SOURCE", cpu_ops.SOURCE.parent / "missing.cpp")
    monkeypatch.setattr(cpu_ops, "torch", types.SimpleNamespace(ops=types.SimpleNamespace(triroute=object())))
    assert cpu_ops.cpu_ops_available() is False and "missing.cpp is not beside this module" in cpu_ops.cpu_ops_error()


def test_opcheck_schemas_fakes_and_mutations():
    gen = torch.Generator().manual_seed(4)
    stores, tables = _mixed_pools([6, 3], 1, 4, gen)
    p = paged_ops.PoolLists.of([s.k_pool for s in stores], [s.v_pool for s in stores])
    lists, bits, gs = p.tensors, p.bits, p.group_size
    q = torch.randn(2, 2, D, generator=gen)
    lo, hi = torch.zeros(2, 2, dtype=torch.long), torch.tensor([5, 2])
    torch.library.opcheck(
        torch.ops.triroute.paged_attention,
        (q, *lists, bits, gs, tables, torch.tensor([0, 1]), lo, hi, 0.25, torch.zeros(2, dtype=torch.long)),
    )
    k = torch.randn(3, 1, D, generator=gen)
    torch.library.opcheck(
        torch.ops.triroute.cache_write,
        (k, k * 2, torch.tensor([0, 3, -1]), torch.tensor([1, 2, 0]), torch.tensor([7, 8, 9]), *lists, bits, gs),
    )
    x = torch.randn(3, 8, generator=gen)
    w = [torch.randn(6, 8, generator=gen)]
    torch.library.opcheck(
        torch.ops.triroute.routed_experts,
        (x, torch.tensor([[0], [-1], [0]]), torch.rand(3, 1), w, w, [torch.randn(8, 6, generator=gen)]),
    )
    counts, tables = torch.tensor([[0, 5], [3, 0], [1, 1], [0, 0]]), torch.tensor([[[0, 1]], [[2, 3]], [[1, 0]], [[3, 2]]]).expand(4, 2, 2).contiguous()
    torch.library.opcheck(
        torch.ops.triroute.cache_append,
        (k[:2], k[:2] * 2, torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([7, 8]), counts, tables, 4, *lists,
         bits, gs),
    )
    torch.library.opcheck(torch.ops.triroute.decode_linear, (x, torch.randn(11, 8, generator=gen)))


def test_the_kernels_run_on_torchs_threads():
    """`at::parallel_for` compiles its OpenMP pragma into the library: built without -fopenmp, every
    kernel ran on one thread whatever torch.set_num_threads said (cpu_ops.CFLAGS)."""
    assert cpu_ops_available(), cpu_ops.cpu_ops_error()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.ops.triroute.parallel_threads(64) == n
    finally:
        torch.set_num_threads(threads)


def test_the_multiply_add_probe_times_its_rounds_and_bounds_the_matmul_kernel():
    """`triroute::fma_probe` (the decode benchmark's `core_gflops`): its time grows with its rounds (the
    compiler kept every multiply-add), and its rate is at least what decode_linear's kernel reaches on
    weights in the caches (a peak bounds the kernels built with it; a probe the chains' latency bound
    would read below that kernel, which reaches about three quarters of the core's peak here while
    PyTorch's matmul reaches two fifths)."""
    assert cpu_ops_available(), cpu_ops.cpu_ops_error()
    with pytest.raises(RuntimeError, match="iterations must be positive"):
        torch.ops.triroute.fma_probe(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def best(iterations):
            runs = [torch.ops.triroute.fma_probe(iterations) for _ in range(3)]
            assert all(flops > 0 for flops, _ in runs)
            return min(seconds for _, seconds in runs), runs[0][0]

        (short, flops), (long, flops4) = best(250_000), best(1_000_000)
        assert flops4 == 4 * flops
        assert 2.5 < long / short < 6.0, (short, long)
        peak = flops4 / long
        lanes = flops / (2 * 12 * 250_000)
        assert lanes in (1, 8, 16)
        if lanes == 1:  # a build without AVX2: decode_linear is PyTorch's matmul, which no probe here bounds
            return
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(1024, 768, generator=gen), torch.randn(16, 768, generator=gen)
        for _ in range(10):
            decode_linear(x, w)
        times = []
        for _ in range(30):
            start = time.perf_counter()
            for _ in range(10):
                decode_linear(x, w)
            times.append((time.perf_counter() - start) / 10)
        achieved = 2 * x.shape[0] * w.numel() / statistics.median(times)
        assert peak >= 0.9 * achieved, (peak / 1e9, achieved / 1e9)
    finally:
        torch.set_num_threads(threads)
