"""The pure-torch kernel twins: bit-exact pool writes and decode attention against naive references."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_triroute.routing.quant import dequantize_groups, quantize_groups
from tests.oracles import pack_kv, unpack_kv
from tests.kernels.scenario import fill_pools, naive_attention
from triroute_kernels import (
    allocate_kv_pools,
    allocate_pool,
    decode_attention_pool_torch,
    dequantize_slots,
    merge_partials,
    quantize_pack_into_torch,
)


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_pack_into_pages_is_bit_exact_with_the_training_quantiser(bits):
    gen = torch.Generator().manual_seed(bits)
    N, H_kv, d, g, P = 7, 2, 16, 8, 4
    x = torch.randn(N, H_kv, d, generator=gen) * 3
    x[2, 1, :g] = 0.75  # a constant group: scale 0, dequantises to the zero exactly
    pool = allocate_pool(bits, num_pages=3, page_size=P, num_kv_heads=H_kv, head_dim=d, group_size=g)
    slots = torch.tensor([5, 0, 11, 3, 8, 1, 6])
    quantize_pack_into_torch(x, bits, g, pool, slots)
    pages = torch.arange(3)
    got = dequantize_slots(pool, pages).reshape(-1, H_kv, d)[slots]
    if bits == 16:
        assert torch.equal(pool.values.view(-1, H_kv, d)[slots], x.half())
        assert torch.equal(got, x.half().float())
        return
    codes, scale, zero = quantize_groups(x, bits, g)
    assert torch.equal(got, dequantize_groups(codes, scale, zero))  # bit for bit, fp32
    assert torch.equal(pool.scale.view(-1, H_kv, d // g)[slots], scale)
    assert torch.equal(pool.zero.view(-1, H_kv, d // g)[slots], zero)
    for i in range(N):  # each (token, head)'s bytes are pack_kv's bytes for that token and head
        for h in range(H_kv):
            ref = pack_kv(x[i : i + 1, h : h + 1], bits, g)
            assert torch.equal(pool.codes.view(-1, H_kv, d * bits // 8)[slots[i], h], ref.codes)
            assert torch.equal(got[i, h], unpack_kv(ref)[0, 0])
    # untouched slots stay empty
    untouched = sorted(set(range(3 * P)) - set(slots.tolist()))
    assert not pool.codes.view(-1, H_kv, d * bits // 8)[untouched].any()


def test_write_rejects_bad_input_with_named_fields():
    pool = allocate_pool(4, 2, 4, 2, 16, 8)
    x = torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match="bits=8"):
        quantize_pack_into_torch(x, 8, 8, pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slots must lie"):
        quantize_pack_into_torch(x, 4, 8, pool, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="group_size=5"):
        allocate_pool(4, 2, 4, 2, 16, 5)
    with pytest.raises(ValueError, match="H_kv"):
        quantize_pack_into_torch(torch.randn(2, 3, 16), 4, 8, pool, torch.tensor([0, 1]))


H_KV, GQA, D, GS, P = 2, 2, 16, 8, 4
H_Q = H_KV * GQA


def _query(B, gen):
    return torch.randn(B, H_Q, D, generator=gen)


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
@pytest.mark.parametrize("pages_per_chunk", [1, 64])
def test_decode_attention_matches_naive_reference(bits, pages_per_chunk):
    gen = torch.Generator().manual_seed(10 + bits)
    # request 0: 9 tokens (last page partly used), request 1: 4 (one full page), request 2: 1 token
    lengths = [list(range(9)), list(range(4)), [0]]
    st = fill_pools(quantize_pack_into_torch, bits, lengths, H_KV, D, GS, P, gen)
    B = len(lengths)
    q = _query(B, gen)
    hi = torch.tensor([8, 3, 0], dtype=torch.int32)
    # per query head: full (lo 0), local windows, a skip (lo > hi); GQA heads of one kv group differ
    lo = torch.tensor([[0, 6, 9, 8], [2, 0, 0, 4], [0, 1, 0, 0]], dtype=torch.int32)
    sm = 1 / math.sqrt(D)
    out, lse = decode_attention_pool_torch(q, st.k_pool, st.v_pool, bits, GS, st.page_table, lo, hi, sm, pages_per_chunk)
    ref_out, ref_lse = naive_attention(q, [st], GS, lo, hi, sm)
    assert torch.allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
    # skipped heads (lo > hi) read nothing: out 0, lse -inf
    for b, h in [(0, 2), (1, 3), (2, 1)]:
        assert lse[b, h] == -math.inf and not out[b, h].any()
    # a local window of one key (lo == hi) returns exactly that key's value
    assert torch.allclose(out[0, 3], ref_out[0, 3]) and ref_lse[0, 3] != -math.inf


def test_hi_excludes_later_tokens_and_free_slots_are_never_read():
    gen = torch.Generator().manual_seed(3)
    st = fill_pools(quantize_pack_into_torch, 4, [list(range(7))], H_KV, D, GS, P, gen)
    q = _query(1, gen)
    lo = torch.zeros(1, H_Q, dtype=torch.int32)
    sm = 0.3
    base, _ = decode_attention_pool_torch(q, st.k_pool, st.v_pool, 4, GS, st.page_table, lo, torch.tensor([4]), sm)
    # garbage in the unused slot of the last page and in later positions must not change the result
    last = int(st.page_table[0, 1])
    assert st.k_pool.token_pos[last].tolist() == [4, 5, 6, -1]
    for pool in (st.k_pool, st.v_pool):  # slots 1, 2 hold positions > hi; slot 3 is free
        pool.codes[last, 1:] = 255
        pool.scale[last, 1:] = 100.0
    again, _ = decode_attention_pool_torch(q, st.k_pool, st.v_pool, 4, GS, st.page_table, lo, torch.tensor([4]), sm)
    assert torch.equal(base, again)
    ref, _ = naive_attention(q, [st], GS, lo, torch.tensor([4]), sm)
    assert torch.allclose(base, ref, atol=1e-5)


def test_lse_merge_of_two_pools_equals_attention_over_their_union():
    gen = torch.Generator().manual_seed(7)
    # each request's positions are split between a 2-bit and a 16-bit pool (interleaved, uneven)
    p2 = [[0, 2, 3, 6, 9, 10], [1, 4], [0]]
    p16 = [[1, 4, 5, 7, 8], [0, 2, 3, 5], []]
    st2 = fill_pools(quantize_pack_into_torch, 2, p2, H_KV, D, GS, P, gen)
    st16 = fill_pools(quantize_pack_into_torch, 16, p16, H_KV, D, GS, P, gen)
    q = _query(3, gen)
    hi = torch.tensor([10, 5, 0], dtype=torch.int32)
    lo = torch.tensor([[0, 5, 11, 9], [0, 4, 1, 6], [0, 0, 1, 0]], dtype=torch.int32)
    sm = 0.25
    outs, lses = zip(*(decode_attention_pool_torch(q, s.k_pool, s.v_pool, s.bits, GS, s.page_table, lo, hi, sm) for s in (st2, st16)))
    out, lse = merge_partials(list(outs), list(lses))
    ref_out, ref_lse = naive_attention(q, [st2, st16], GS, lo, hi, sm)
    assert torch.allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-5)
    # request 2 head 3 reads only from the 2-bit pool (the 16-bit pool holds nothing for it)
    assert lses[1][2, 3] == -math.inf and torch.allclose(out[2, 3], outs[0][2, 3])


def test_read_rejects_bad_shapes():
    k, v = allocate_kv_pools(4, 2, 4, 2, 16, 8)
    q = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="H_q=3"):
        decode_attention_pool_torch(q, k, v, 4, 8, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="page_table holds page 5"):
        decode_attention_pool_torch(torch.randn(1, 4, 16), k, v, 4, 8, torch.tensor([[5]], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 1.0)


def test_dispatch_chooses_torch_on_cpu_and_names_bad_backends(monkeypatch):
    from triroute_kernels import choose_backend

    monkeypatch.delenv("TRIROUTE_KERNELS", raising=False)
    assert choose_backend(torch.device("cpu")) == "torch"
    assert choose_backend(torch.device("cuda"), "torch") == "torch"
    monkeypatch.setenv("TRIROUTE_KERNELS", "cuda-please")
    with pytest.raises(ValueError, match="TRIROUTE_KERNELS"):
        choose_backend(torch.device("cpu"))


class _Work(TorchDispatchMode):
    """Counts what the ops run inside it execute: matmul multiply-accumulates, and the elements
    gathered from payload tensors (codes, scales, zeros, float16 values; the int32 positions are
    not payload)."""

    def __init__(self, *pools):
        super().__init__()
        self.payload = {t.data_ptr() for pool in pools for t in pool.storage_tensors()}
        self.macs = 0
        self.gathered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
            self.macs += args[0].numel() * args[1].shape[-1]
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default) and args[0].data_ptr() in self.payload:
            self.gathered += out.numel()
        return out


def _slot_elements(bits: int) -> int:
    """Payload elements of one (slot, kv head): codes bytes plus scale and zero, or the float16 values."""
    return D if bits >= 16 else D * bits // 8 + 2 * (D // GS)


@pytest.mark.parametrize("bits", [4, 16])
def test_decode_attention_does_only_the_selected_work(bits):
    """Local heads gather and score only the pages of their window, a kv group none of whose
    heads reads gathers nothing, and an all-skip batch does no score or output work."""
    gen = torch.Generator().manual_seed(30 + bits)
    lengths = [list(range(203)), list(range(150))]  # 51 and 38 pages of P = 4
    st = fill_pools(quantize_pack_into_torch, bits, lengths, H_KV, D, GS, P, gen)
    B = len(lengths)
    q = _query(B, gen)
    hi = torch.tensor([202, 149], dtype=torch.int32)
    sm = 1 / math.sqrt(D)
    w = 9  # a local head reads max(0, t - w)..t: 10 keys, at most ceil(10 / P) + 1 = 4 pages
    window_pages = math.ceil((w + 1) / P) + 1

    def run(lo):
        with _Work(st.k_pool, st.v_pool) as work:
            out, lse = decode_attention_pool_torch(q, st.k_pool, st.v_pool, bits, GS, st.page_table, lo, hi, sm)
        ref_out, ref_lse = naive_attention(q, [st], GS, lo, hi, sm)
        assert torch.allclose(out, ref_out, atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        return work

    # every head local: per (request, kv head) at most window_pages pages gathered (K and V) and
    # scored for the group's G heads (QK and PV), whatever the context
    local = (hi - w).clamp_min(0).view(B, 1).expand(B, H_Q).contiguous()
    work = run(local)
    blocks = B * H_KV * window_pages
    assert 0 < work.gathered <= 2 * blocks * P * _slot_elements(bits)
    assert 0 < work.macs <= 2 * blocks * GQA * P * D
    full_macs = 2 * H_Q * D * (len(lengths[0]) + len(lengths[1]))
    assert work.macs * 8 < full_macs

    # kv group 0 skips (lo > hi) in both requests, group 1 reads everything: only kv head 1 is gathered
    lo = torch.tensor([[203, 203, 0, 0], [150, 150, 0, 0]], dtype=torch.int32)
    work = run(lo)
    pages = sum(math.ceil(len(p) / P) for p in lengths)
    assert 0 < work.gathered <= 2 * pages * P * _slot_elements(bits)
    assert work.macs <= 2 * pages * P * GQA * D

    # every head skips: nothing gathered, nothing scored
    work = run(hi.view(B, 1).expand(B, H_Q) + 1)
    assert work.gathered == 0 and work.macs == 0
