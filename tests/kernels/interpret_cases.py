"""Triton kernels vs the torch twins on tiny shapes. Not collected directly (the file name has no
test_ prefix): test_triton_interpret.py runs it in a subprocess with TRITON_INTERPRET=1 set before
triton is imported, so the kernels execute on CPU."""

import math
import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_triton_interpret.py"

from megatron_triroute.routing.quant import dequantize_groups, quantize_groups  # noqa: E402
from tests.kernels.scenario import fill_pools, naive_attention  # noqa: E402
from triroute_kernels import (  # noqa: E402
    allocate_pool,
    decode_attention_pool,
    decode_attention_pool_torch,
    dequantize_slots,
    merge_partials,
    quantize_pack_into,
    quantize_pack_into_torch,
)
from triroute_kernels.triton_ops import (  # noqa: E402
    check_triton_layout,
    decode_attention_pool_triton,
    default_splits,
    quantize_pack_into_triton,
)

H_KV, GQA, D, GS, P = 2, 2, 16, 8, 4


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_triton_write_is_byte_identical_to_the_torch_twin(bits):
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(5, H_KV, D, generator=gen) * 3
    x[1, 0, :GS] = 0.5  # constant group
    # exact ties: group [0 .. levels] plus halves, so round-half-to-even is exercised
    levels = 2 ** min(bits, 8) - 1
    tie = torch.linspace(0, levels, GS)
    tie[1:4] = torch.tensor([0.5, 1.5, 2.5])  # scale (levels - 0) / levels = 1: these codes are exact ties
    x[2, 1, :GS] = tie
    slots = torch.tensor([3, 0, 7, 5, 1])
    a = allocate_pool(bits, 2, P, H_KV, D, GS)
    b = allocate_pool(bits, 2, P, H_KV, D, GS)
    quantize_pack_into(x, bits, GS, a, slots, backend="triton")
    quantize_pack_into_torch(x, bits, GS, b, slots)
    for ta, tb in zip(a.storage_tensors(), b.storage_tensors()):
        assert torch.equal(ta, tb)
    got = dequantize_slots(a, torch.arange(2)).reshape(-1, H_KV, D)[slots]
    if bits == 16:
        assert torch.equal(got, x.half().float())
    else:
        assert torch.equal(got, dequantize_groups(*quantize_groups(x, bits, GS)))


@pytest.mark.parametrize("bits", [2, 8, 16])
def test_triton_decode_attention_matches_torch_and_naive(bits):
    gen = torch.Generator().manual_seed(20 + bits)
    lengths = [list(range(9)), list(range(4)), [0]]
    st = fill_pools(quantize_pack_into_triton, bits, lengths, H_KV, D, GS, P, gen)
    q = torch.randn(3, H_KV * GQA, D, generator=gen)
    hi = torch.tensor([8, 3, 0], dtype=torch.int32)
    lo = torch.tensor([[0, 6, 9, 8], [2, 0, 0, 4], [0, 1, 0, 0]], dtype=torch.int32)
    sm = 1 / math.sqrt(D)
    out, lse = decode_attention_pool(q, st.k_pool, st.v_pool, bits, GS, st.page_table, lo, hi, sm, backend="triton")
    t_out, t_lse = decode_attention_pool_torch(q, st.k_pool, st.v_pool, bits, GS, st.page_table, lo, hi, sm)
    r_out, r_lse = naive_attention(q, [st], GS, lo, hi, sm)
    for o, l in ((t_out, t_lse), (r_out, r_lse)):
        assert torch.allclose(out, o, atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.isinf(lse), torch.isinf(l))
        fin = torch.isfinite(l)
        assert torch.allclose(lse[fin], l[fin], atol=1e-5, rtol=1e-5)
    assert lse[0, 2] == -math.inf and not out[0, 2].any()  # skipped head
    # split-K: the page list cut in parts read by separate programs, merged by log-sum-exp
    s_out, s_lse = decode_attention_pool_triton(q, st.k_pool, st.v_pool, bits, GS, st.page_table, lo, hi, sm, num_splits=2)
    assert torch.allclose(s_out, r_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(s_lse), torch.isinf(r_lse))
    assert torch.allclose(s_lse[fin], r_lse[fin], atol=1e-5, rtol=1e-5)


def test_triton_lse_merge_of_two_pools_equals_union():
    gen = torch.Generator().manual_seed(5)
    st4 = fill_pools(quantize_pack_into_triton, 4, [[0, 2, 3, 6, 7], [1]], H_KV, D, GS, P, gen)
    st16 = fill_pools(quantize_pack_into_triton, 16, [[1, 4, 5], [0, 2]], H_KV, D, GS, P, gen)
    q = torch.randn(2, H_KV * GQA, D, generator=gen)
    hi = torch.tensor([7, 2], dtype=torch.int32)
    lo = torch.tensor([[0, 3, 8, 7], [0, 2, 1, 3]], dtype=torch.int32)
    parts = [decode_attention_pool(q, s.k_pool, s.v_pool, s.bits, GS, s.page_table, lo, hi, 0.3, backend="triton") for s in (st4, st16)]
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    r_out, r_lse = naive_attention(q, [st4, st16], GS, lo, hi, 0.3)
    assert torch.allclose(out, r_out, atol=1e-5, rtol=1e-5)
    fin = torch.isfinite(r_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.allclose(lse[fin], r_lse[fin], atol=1e-5)


def test_triton_layout_limits_are_named():
    with pytest.raises(ValueError, match="head_dim"):
        check_triton_layout(4, 24, 8, 4)
    with pytest.raises(ValueError, match="group_size"):
        check_triton_layout(2, 16, 2, 4)
    with pytest.raises(ValueError, match="page_size"):
        check_triton_layout(8, 16, 8, 6)


def test_default_splits_fill_the_device_but_keep_pages_per_split():
    assert default_splits(rows=12, max_pages=4) == 1  # too few pages to split
    assert default_splits(rows=1, max_pages=512) == 128  # 4 pages per split at most 512 programs
    assert default_splits(rows=8 * 12, max_pages=512) == 5
    assert default_splits(rows=4096, max_pages=512) == 1


# --- the all-pools paged attention (triton_paged) -----------------------------------------------
from tests.kernels.scenario import mixed_pools  # noqa: E402
from triroute_kernels import PoolLists  # noqa: E402
from triroute_kernels.paged_ops import paged_attention_torch  # noqa: E402
from triroute_kernels.triton_paged import codes_fits, dot_fits, paged_attention_triton, used_entries  # noqa: E402


def test_dot_only_where_both_of_its_reductions_reach_sixteen():
    """tl.dot does not compile a reduction shorter than 16 on a GPU (the interpreter takes any):
    a head dim of 8, or blocks of 8 slots, take the broadcast products instead."""
    assert dot_fits(16, 16) and dot_fits(64, 64)
    assert not dot_fits(8, 64) and not dot_fits(64, 8)


@pytest.mark.parametrize("H_kv,H,splits,knobs", [
    (1, 3, 1, {}), (2, 4, 2, {}), (4, 4, 3, {}),
    # the tuning knobs' other settings (bench_paged_attention.py --variants)
    (2, 4, 2, {"dot": False, "skip": True}), (1, 3, 1, {"packed": False, "pages_per_block": 1}),
    (2, 4, 2, {"precision": "ieee", "pages_per_block": 2}),
    (1, 3, 1, {"skip": True, "pages_per_block": 2}), (2, 4, 2, {"early": True}),
    (4, 4, 3, {"early": True, "pages_per_block": 2}), (1, 3, 1, {"codes": True}),
    (2, 4, 2, {"codes": True, "early": True}), (4, 4, 3, {"codes": True, "pages_per_block": 2})])
def test_triton_paged_attention_over_all_pools_matches_the_twin_and_its_counters(H_kv, H, splits, knobs):
    """Mixed widths in one batch, GQA groups of 1-3 heads (3: a padded group), full, local and
    skipped heads within one group, decode and prefill rows, split-K; output to 1e-5 and the
    executed counters equal to the twin's."""
    gen = torch.Generator().manual_seed(10 * H_kv + H + splits)
    lengths = [37, 9, 1, 20]
    stores, tables = mixed_pools(lengths, H_kv, P, gen, (2, 4, 8, 16), D, GS)
    request = torch.tensor([0, 1, 2, 3, 0, 0], dtype=torch.long)
    hi = torch.tensor([36, 8, 0, 19, 5, 30], dtype=torch.long)
    N = len(request)
    modes = torch.randint(0, 3, (N, H), generator=gen)
    lo = torch.where(modes == 0, 0, (hi.view(N, 1) - 6).clamp_min(0))
    lo = torch.where(modes == 2, hi.view(N, 1) + 1, lo)
    lo[0, 0], lo[1, H - 1] = 0, hi[1] + 1
    q = torch.randn(N, H, D, generator=gen)
    pools = PoolLists.of([s.k_pool for s in stores], [s.v_pool for s in stores])
    got_c, want_c = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    got = paged_attention_triton(q, pools, tables, request, lo, hi, 0.3, got_c, num_splits=splits, **knobs)
    want = paged_attention_torch(q, pools.k_pools, pools.v_pools, tables, request, lo, hi, 0.3, want_c)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert got_c[0] == want_c[0] > 0
    if knobs.get("early"):  # the bytes of whole loaded pages: the slots past a row's last position too
        assert got_c[1] > want_c[1]
    else:
        assert got_c[1] == want_c[1]
    assert not got[lo > hi.view(N, 1)].any()


@pytest.mark.parametrize("pages_per_block", [1, 4])
def test_triton_paged_attention_stops_at_each_rows_last_page_and_skips_holes(pages_per_block):
    """A pool a row never wrote to, a -1 hole inside a row's table and -1 entries after its last
    page: the loops end at each (pool, row)'s last page (`used_entries`) and the result and
    counters equal the twin's."""
    gen = torch.Generator().manual_seed(7)
    stores, tables = mixed_pools([40, 25], 2, P, gen, (2, 4, 8, 16), D, GS)
    tables = torch.cat([tables, torch.full_like(tables[..., :3], -1)], -1)  # room past every row's pages
    tables[1] = -1  # the 4-bit pool: no row holds pages there
    tables[0, 0, 1] = -1  # a hole: the page (and its tokens) left out of row 0's 2-bit table
    used = used_entries(tables)
    assert used[1].tolist() == [0, 0] and used[0, 0] == int((tables[0, 0] >= 0).nonzero().max()) + 1
    request, hi = torch.tensor([0, 1]), torch.tensor([39, 24])
    lo = torch.zeros(2, 4, dtype=torch.long)
    q = torch.randn(2, 4, D, generator=gen)
    pools = PoolLists.of([s.k_pool for s in stores], [s.v_pool for s in stores])
    got_c, want_c = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    got = paged_attention_triton(q, pools, tables, request, lo, hi, 0.3, got_c, pages_per_block=pages_per_block)
    want = paged_attention_torch(q, pools.k_pools, pools.v_pools, tables, request, lo, hi, 0.3, want_c)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert torch.equal(got_c, want_c) and got_c[0] > 0


@pytest.mark.parametrize("group", [D, D // 4])
def test_codes_domain_with_one_group_per_head_and_where_it_does_not_fit(group):
    """The codes-domain block with one quantisation group per head (the group is the head), and a
    layout of four groups, which `codes_fits` sends to the dequantising block: both equal the twin."""
    gen = torch.Generator().manual_seed(11)
    stores, tables = mixed_pools([21, 6], 2, P, gen, (2, 4, 8, 16), D, group)
    request, hi = torch.tensor([0, 1, 0]), torch.tensor([20, 5, 9])
    lo = torch.tensor([[0, 3, 0, 0], [0, 0, 1, 0], [4, 0, 0, 10]])
    q = torch.randn(3, 4, D, generator=gen)
    pools = PoolLists.of([s.k_pool for s in stores], [s.v_pool for s in stores])
    assert codes_fits(D, group, 4 * P, q.device) == (group == D)
    got_c, want_c = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    got = paged_attention_triton(q, pools, tables, request, lo, hi, 0.3, got_c, codes=True)
    want = paged_attention_torch(q, pools.k_pools, pools.v_pools, tables, request, lo, hi, 0.3, want_c)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert torch.equal(got_c, want_c) and got_c[0] > 0


def test_triton_paged_attention_never_reads_pages_before_every_head_of_the_group():
    """NaN payload in the pages wholly before the group's earliest start must not reach the output."""
    gen = torch.Generator().manual_seed(4)
    st = fill_pools(quantize_pack_into_torch, 4, [list(range(50))], 1, D, GS, P, gen)
    tables = st.page_table.long().unsqueeze(0)
    for pool in (st.k_pool, st.v_pool):
        pool.scale[tables[0, 0, :10]] = float("nan")  # positions 0..39
    pools = PoolLists.of([st.k_pool], [st.v_pool])
    q = torch.randn(1, 2, D, generator=gen)
    lo, hi = torch.tensor([[44, 40]]), torch.tensor([49])
    c = torch.zeros(2, dtype=torch.long)
    got = paged_attention_triton(q, pools, tables, torch.tensor([0]), lo, hi, 0.25, c)
    want = naive_attention(q, [st], GS, lo, hi, 0.25)[0]
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert c.tolist()[0] == 2 * D * (6 + 10)


@pytest.mark.parametrize("knobs", [{}, {"early": True}, {"early": True, "codes": True}])
def test_triton_paged_attention_ignores_the_payload_of_slots_past_the_row(knobs):
    """NaN payload in slots past the row's last position, on pages it reads: with the loads masked by
    the page (early) they are fetched, and must still add nothing."""
    gen = torch.Generator().manual_seed(5)
    st = fill_pools(quantize_pack_into_torch, 4, [list(range(50))], 1, D, GS, P, gen)
    tables = st.page_table.long().unsqueeze(0)
    past = st.k_pool.token_pos > 44
    assert past.any() and (st.k_pool.token_pos[tables[0, 0]] > 44).any()
    for pool in (st.k_pool, st.v_pool):
        pool.scale[past] = float("nan")
    pools = PoolLists.of([st.k_pool], [st.v_pool])
    q = torch.randn(1, 2, D, generator=gen)
    lo, hi = torch.tensor([[0, 0]]), torch.tensor([44])
    c = torch.zeros(2, dtype=torch.long)
    got = paged_attention_triton(q, pools, tables, torch.tensor([0]), lo, hi, 0.25, c, **knobs)
    want = naive_attention(q, [st], GS, lo, hi, 0.25)[0]
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert c.tolist()[0] == 2 * D * 2 * 45


# --- the all-pools cache append (triton_append) -----------------------------------------------------
from tests.kernels.test_paged_ops import _decode_state, _fresh_pools  # noqa: E402
from triroute_kernels.paged_ops import cache_append, cache_write_torch  # noqa: E402


def test_triton_cache_append_writes_each_tokens_next_slot_as_the_twin_does(monkeypatch):
    """One launch for every pool: each token's slot from its pool's count and page table, K and V
    quantised there bit for bit as the twin writes them, its position recorded, the counts advanced;
    a token whose pool holds no page for its slot (or that names no pool) is written nowhere and
    counted in `lost`, the others written all the same."""
    from tests.kernels.test_paged_ops import D as PD, WIDTHS
    from triroute_kernels import paged_ops

    monkeypatch.setenv("TRIROUTE_KERNELS", "triton")  # the path a GPU takes, not the C++ kernel
    monkeypatch.setattr(paged_ops, "cpu_ops_available", lambda: False)
    gen = torch.Generator().manual_seed(23)
    H_kv, P, R, width = 2, 4, 7, 3
    pages = R * width + 2
    counts, tables = _decode_state(R, pages, P, width, gen)
    tables[2, 6, :] = -1
    counts[2, 6] = 0  # row 6 holds no page in pool 2
    rows = torch.tensor([4, 0, 5, 2, 1, 3, 6])  # distinct, any order
    option = torch.tensor([0, 3, 1, 3, 2, 0, 2])  # every width; the last token finds no page
    N = len(rows)
    k, v = torch.randn(N, H_kv, PD, generator=gen) * 2, torch.randn(N, H_kv, PD, generator=gen)
    positions = torch.tensor([7, 100, 3, 42, 9, 11, 5])
    index = counts[option, rows].clone()
    slots = tables[option, rows, index // P] * P + index % P
    c, pools, lost = counts.clone(), _fresh_pools(H_kv, P, pages), torch.zeros(1, dtype=torch.long)
    cache_append(k, v, option, rows, positions, c, tables, P, PoolLists.of(*pools), lost)
    expected = counts.clone()
    expected[option, rows] += 1
    assert torch.equal(c, expected) and lost.tolist() == [1]
    reference = _fresh_pools(H_kv, P, pages)
    kept = torch.arange(N) < N - 1
    cache_write_torch(k[kept], v[kept], option[kept], slots[kept], positions[kept], *reference)
    assert len(pools[0]) == len(WIDTHS)
    for a, b in zip(pools[0] + pools[1], reference[0] + reference[1]):
        assert torch.equal(a.token_pos, b.token_pos), a.bits
        assert all(torch.equal(ta, tb) for ta, tb in zip(a.storage_tensors(), b.storage_tensors())), a.bits
    with pytest.raises(ValueError, match="needs `lost`"):
        cache_append(k, v, option, rows, positions, c, tables, P, PoolLists.of(*pools))


def _decode(steps: int):
    """Logits of a tiny model's `steps` decode steps after a prefill, and each step's host syncs."""
    from benchmarks.op_counter import StepCounter
    from tests.inference.test_decode_step import decode_steps
    from tests.inference.test_engine import tiny_model

    logits, counters = zip(*decode_steps(tiny_model(), steps, StepCounter))
    return torch.stack(logits), [c.syncs for c in counters]


def test_a_decode_step_as_a_gpu_runs_it_reads_nothing_back_and_equals_the_cpu_kernels(monkeypatch):
    """The engine's decode step on the path a GPU takes (the Triton attention and append, the static
    experts on stacked weights, no C++ op), here under the interpreter: no host read in any step,
    and the logits of the CPU's C++ kernels."""
    from triroute_kernels import cpu_ops

    want, _ = _decode(2)
    monkeypatch.setenv("TRIROUTE_KERNELS", "triton")
    monkeypatch.setitem(cpu_ops._state, "ok", False)
    got, syncs = _decode(2)
    assert syncs == [{}, {}], syncs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("position_rows", [1, 3])
def test_triton_noise_hash_equals_the_tensor_chain_bit_for_bit(position_rows):
    from megatron_triroute.routing.noise import counter_uniform_torch, counter_words
    from triroute_kernels.triton_noise import counter_uniform_triton

    gen = torch.Generator().manual_seed(position_rows)
    words = lambda *shape: torch.randint(0, 2**32, shape, generator=gen, dtype=torch.int64)  # noqa: E731
    prefix, sample, positions = words(2), words(3), words(position_rows, 70)  # 420 rows: several blocks
    prefix[0], sample[1] = 2**32 - 1, 0
    counters = counter_words(5, "cpu")  # n below the block's power of two
    out = counter_uniform_triton(prefix, sample, positions, counters)
    assert out.shape == (2, 3, 70, 5) and out.dtype == torch.float64
    assert torch.equal(out, counter_uniform_torch(prefix, sample, positions, counters))


def test_triton_chain_words_equal_the_tensor_chain_bit_for_bit():
    from megatron_triroute.routing import noise
    from triroute_kernels.triton_noise import chain_words_triton

    gen = torch.Generator().manual_seed(5)
    keys = torch.randint(0, 2**32, (3, 700), generator=gen, dtype=torch.int64)  # 2,100 keys: several blocks
    keys[0, :4] = torch.tensor([0, 2**31, 2**32 - 1, 2**40 + 5])
    for field in (4, 5):
        assert torch.equal(chain_words_triton(keys, field), noise.chain_words_torch(keys, field))
    assert noise._checked_words_kernel(torch.device("cpu")) is chain_words_triton


def test_triton_noise_is_taken_only_after_its_first_use_check(monkeypatch):
    """The probe comparison the GPU path runs once per device: the kernel passes it; a kernel that
    gives other bits, or fails to build, is left out with a warning naming why."""
    import triroute_kernels.triton_noise as tn

    from megatron_triroute.routing import noise

    assert noise._checked_triton_kernel(torch.device("cpu")) is tn.counter_uniform_triton
    monkeypatch.setattr(tn, "counter_uniform_triton", lambda *a: noise.counter_uniform_torch(*a) + 1e-9)
    with pytest.warns(UserWarning, match="values differ"):
        assert noise._checked_triton_kernel(torch.device("cpu")) is None
    monkeypatch.setattr(tn, "counter_uniform_triton", lambda *a: (_ for _ in ()).throw(RuntimeError("no PTX")))
    with pytest.warns(UserWarning, match="RuntimeError: no PTX"):
        assert noise._checked_triton_kernel(torch.device("cpu")) is None


# --- the relaxed K/V write's values (triton_quant) ----------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, group, d", [((2, 4, 8, 16), 8, 32), ((16, 8), 32, 64), ((4,), 16, 16),
                                             ((16,), 8, 8), ((8, 2, 16), 32, 32)])
def test_triton_quantized_values_equal_the_chain_bit_for_bit(dtype, bits, group, d):
    """Every width's values in one launch against `quantized_values_torch` (the definition), with a
    constant group, rounding ties, large and tiny magnitudes, and a row count that leaves a partial
    block of rows."""
    from megatron_triroute.routing.quant import quantized_values_torch
    from triroute_kernels.triton_quant import quantized_values_triton

    gen = torch.Generator().manual_seed(len(bits) * 100 + group + d)
    x = torch.randn(3, 7, 2, d, generator=gen) * torch.logspace(-3, 3, 7).view(1, 7, 1, 1)
    x[0, 0, 0, :group] = -1.5  # scale 0
    x[0, 1, 1, :group] = torch.arange(group) * 0.5  # ties at some widths
    x = x.to(dtype)
    got = quantized_values_triton(x, bits, group, rows_per_program=4)
    want = quantized_values_torch(x, bits, group)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == (3, 7, len(bits), 2 * d)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_triton_quantized_values_refuse_a_layout_they_do_not_take():
    from triroute_kernels.triton_quant import fits, quantized_values_triton

    x = torch.randn(1, 2, 2, 24)
    assert not fits(x, (2, 16), 8) and fits(torch.randn(1, 2, 2, 32), (2, 16), 8)
    with pytest.raises(ValueError, match="use quantized_values_torch"):
        quantized_values_triton(x, (2, 16), 8)


def test_triton_quantized_values_are_taken_only_after_their_first_use_check(monkeypatch):
    """The probe comparison a GPU's first relaxed write of a layout runs: the kernel passes it; a
    kernel that gives other values is left out with a warning, and the chain serves."""
    import triroute_kernels.triton_quant as tq

    from megatron_triroute.routing import quant

    cpu = torch.device("cpu")
    assert quant.checked_values_kernel(cpu, torch.bfloat16, 2, 32, (2, 4, 8, 16), 8) is tq.quantized_values_triton
    monkeypatch.setattr(tq, "quantized_values_triton", lambda x, *a: quant.quantized_values_torch(x, *a) * 1.001)
    with pytest.warns(UserWarning, match="relaxed K/V write's values.*values differ"):
        assert quant.checked_values_kernel(cpu, torch.float32, 2, 32, (2, 16), 8) is None


# --- the relaxed attention's mode mix (triton_mix) ----------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [8, 32])
def test_triton_mode_mix_gives_the_definitions_values(dtype, d):
    """On straight-through one-hots (what training mixes with): the forward and d attn bit for bit
    against the tensor ops, d modes within float32 rounding of the exact sums (zero in SKIP's
    column); the output token-major, each d attn_m laid out as attn_m; rows that leave a partial
    block. Soft weights within rounding (the interpreter's multiply-add and bfloat16 casts are
    not a GPU's)."""
    import torch.nn.functional as F

    from megatron_triroute.model.mode_mix import mix_backward_torch, mix_torch
    from megatron_triroute.routing.modes import N_MODES, READING_MODES, SKIP
    from triroute_kernels.triton_mix import mode_mix_backward_triton, mode_mix_triton

    g = torch.Generator().manual_seed(d)
    logits = torch.randn(2, 7, 6, N_MODES, generator=g)
    attn = (torch.randn(2, 7, 5, d, generator=g).to(dtype), torch.randn(2, 5, 7, d, generator=g).to(dtype).transpose(1, 2))
    grad = torch.randn(2, 7, 5, d, generator=g).to(dtype)
    columns = list(READING_MODES)
    for soft in (False, True):
        modes = (logits.softmax(-1) if soft else F.one_hot(logits.argmax(-1), N_MODES).float())[:, :, :5]
        out = mode_mix_triton(modes, attn, columns)
        d_modes, d_attn = mode_mix_backward_triton(grad, modes, attn, columns)
        ref_out, (ref_modes, ref_attn) = mix_torch(modes, attn), mix_backward_torch(grad, modes, attn)
        assert out.transpose(0, 1).is_contiguous() and all(x.stride() == a.stride() for x, a in zip(d_attn, attn))
        assert torch.equal(d_modes[..., SKIP], torch.zeros_like(d_modes[..., SKIP]))
        for m, a in zip(columns, attn):
            exact = (grad.double() * a.double()).sum(-1)
            torch.testing.assert_close(d_modes[..., m].double(), exact, rtol=1e-5, atol=1e-5)
        if soft:
            tol = dict(rtol=2**-5, atol=2**-5) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)  # bf16: ulps
            torch.testing.assert_close(out, ref_out, **tol)
            for x, y in zip(d_attn, ref_attn):
                torch.testing.assert_close(x, y, **tol)
        else:
            assert torch.equal(out, ref_out)
            assert all(torch.equal(x, y) for x, y in zip(d_attn, ref_attn))


def test_triton_mode_mix_is_taken_only_after_its_first_use_check(monkeypatch):
    """The probe a GPU's first mix of a layout runs: the kernels pass it; kernels that give other
    values, or fail to build, are left out with a warning, and the tensor ops serve."""
    import triroute_kernels.triton_mix as tm

    from megatron_triroute.model import mode_mix

    cpu = torch.device("cpu")
    assert mode_mix._checked_triton(cpu, torch.bfloat16, torch.float32, 16) == (tm.mode_mix_triton,
                                                                                 tm.mode_mix_backward_triton)
    real_backward = tm.mode_mix_backward_triton
    monkeypatch.setattr(tm, "mode_mix_backward_triton",
                        lambda *a: (lambda dm, da: (dm * 1.001, da))(*real_backward(*a)))
    with pytest.warns(UserWarning, match="mode mix.*values differ"):
        assert mode_mix._checked_triton(cpu, torch.float32, torch.float32, 16) is None
    monkeypatch.setattr(tm, "mode_mix_triton", lambda *a: (_ for _ in ()).throw(RuntimeError("no PTX")))
    with pytest.warns(UserWarning, match="RuntimeError: no PTX"):
        assert mode_mix._checked_triton(cpu, torch.float32, torch.float32, 16) is None


# --- the experts' combine (triton_mix) -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, D", [(1, 16), (2, 16), (3, 16), (2, 300)])
def test_triton_combine_gives_the_definitions_values(dtype, k, D):
    """out (weighted and not) and d y bit for bit in float32 (within bfloat16 ulps in bfloat16: the
    interpreter's casts truncate), d weight within float32 rounding of the exact sums and 0 for a null route; NaN
    in the null routes' rows (computed by no matmul) reaches nothing; a partial block of rows."""
    from megatron_triroute.experts.combine import combine_backward_torch, combine_torch
    from megatron_triroute.experts.routes import sort_routes
    from triroute_kernels.triton_mix import combine_routes_backward_triton, combine_routes_triton

    g = torch.Generator().manual_seed(k)
    N = 19
    index = torch.randint(-1, 4, (N, k), generator=g)
    index[3] = -1
    order, inverse, *_ = sort_routes(index, 4)
    y = torch.randn(N * k, D, generator=g).to(dtype)
    y[(index < 0).view(-1)[order]] = float("nan")
    weight, grad = torch.rand(N, k, generator=g), torch.randn(N, D, generator=g).to(dtype)
    out = combine_routes_triton(y, inverse, index, weight)
    d_y, d_weight = combine_routes_backward_triton(grad, y, order, inverse, index, weight)
    ref_out, (ref_y, _) = combine_torch(y, inverse, index, weight), combine_backward_torch(grad, y, order, inverse, index, weight)
    assert torch.isfinite(out).all() and torch.isfinite(d_weight).all()
    unweighted, ref_unweighted = combine_routes_triton(y, inverse, index, None), combine_torch(y, inverse, index, None)
    assert torch.isfinite(unweighted).all()
    if dtype == torch.float32:
        assert torch.equal(out, ref_out) and torch.equal(d_y, ref_y) and torch.equal(unweighted, ref_unweighted)
    else:
        torch.testing.assert_close(unweighted, ref_unweighted, rtol=2**-5, atol=2**-5)
        torch.testing.assert_close(out, ref_out, rtol=2**-5, atol=2**-5)
        torch.testing.assert_close(d_y, ref_y, rtol=2**-5, atol=2**-5)
    rows = torch.where((index >= 0).view(-1, 1), y.index_select(0, inverse), 0).double()
    exact = (grad.double().repeat_interleave(k, 0) * rows).sum(-1).view(N, k)
    torch.testing.assert_close(d_weight.double(), exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(d_weight[index < 0], torch.zeros(int((index < 0).sum())))


def test_triton_combine_is_taken_only_after_its_first_use_check(monkeypatch):
    """The probe a GPU's first combine of a layout runs: the kernels pass it; kernels that give
    other values, or fail to build, are left out with a warning, and the tensor ops serve."""
    import triroute_kernels.triton_mix as tm

    from megatron_triroute.experts import combine

    cpu = torch.device("cpu")
    assert combine._checked_triton(cpu, torch.float32, torch.float32, 16) == (tm.combine_routes_triton,
                                                                              tm.combine_routes_backward_triton)
    real_forward = tm.combine_routes_triton
    monkeypatch.setattr(tm, "combine_routes_triton", lambda *a: real_forward(*a) * 1.001)
    with pytest.warns(UserWarning, match="experts' combine.*values differ"):
        assert combine._checked_triton(cpu, torch.float32, torch.float32, 16) is None
    monkeypatch.setattr(tm, "combine_routes_backward_triton", lambda *a: (_ for _ in ()).throw(RuntimeError("no PTX")))
    with pytest.warns(UserWarning, match="RuntimeError: no PTX"):
        assert combine._checked_triton(cpu, torch.float32, torch.float32, 16) is None


# --- the relaxed K/V write's sum over widths (triton_quant) ---------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths, D", [(4, 24), (2, 64), (3, 8)])
def test_triton_write_sum_gives_the_matmuls_values(dtype, widths, D):
    """On straight-through one-hots the chosen width's values exactly, in the shape asked for;
    d y within float32 rounding of the exact sums; a row count that leaves a partial block and a
    width of channels that is not a power of two."""
    from triroute_kernels.triton_quant import relaxed_write_backward_triton, relaxed_write_triton

    g = torch.Generator().manual_seed(widths * D)
    values = torch.randn(3, 7, widths, D, generator=g).to(dtype)
    y = torch.nn.functional.one_hot(torch.randint(0, widths, (3, 7), generator=g), widths).float()
    grad = torch.randn(3, 7, D, generator=g).to(dtype)
    out = relaxed_write_triton(values, y, [3, 7, 2, D // 2], rows_per_program=4)
    assert out.shape == (3, 7, 2, D // 2) and out.dtype == dtype
    assert torch.equal(out, (y.to(dtype).unsqueeze(-2) @ values).view(3, 7, 2, D // 2))
    exact = (values.double() @ grad.double().unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(relaxed_write_backward_triton(values, grad, rows_per_program=4).double(), exact,
                               rtol=1e-5, atol=1e-5)


def test_triton_write_sum_is_taken_only_after_its_first_use_check(monkeypatch):
    import triroute_kernels.triton_quant as tq

    from megatron_triroute.routing import quant

    cpu = torch.device("cpu")
    assert quant.checked_write_kernels(cpu, torch.float32, torch.float32, 4) == (tq.relaxed_write_triton,
                                                                                 tq.relaxed_write_backward_triton)
    real_backward = tq.relaxed_write_backward_triton
    monkeypatch.setattr(tq, "relaxed_write_backward_triton", lambda *a: real_backward(*a) + 1e-3)
    with pytest.warns(UserWarning, match="relaxed K/V write's sum.*values differ"):
        assert quant.checked_write_kernels(cpu, torch.float32, torch.float32, 3) is None
    monkeypatch.setattr(tq, "relaxed_write_triton", lambda *a: (_ for _ in ()).throw(RuntimeError("no PTX")))
    with pytest.warns(UserWarning, match="RuntimeError: no PTX"):
        assert quant.checked_write_kernels(cpu, torch.float32, torch.float32, 2) is None


# --- the straight-through Gumbel sample (triton_gumbel) -------------------------------------------
@pytest.mark.parametrize("shape", [(3, 70, 3), (5, 7, 4, 4), (9, 16)])
def test_triton_straight_through_pair_gives_the_definitions_values(shape):
    """One-hots exactly (a tied row's first maximum), the relaxed sample and both views'
    gradients within float32 rounding of the tensor ops; a partial block of rows and a row of 16
    options."""
    from megatron_triroute.routing.gumbel import soft_gumbel_sample
    from triroute_kernels.triton_gumbel import st_gumbel_backward_triton, st_gumbel_triton

    g = torch.Generator().manual_seed(len(shape))
    z = torch.randn(*shape, generator=g) * 2
    noise = -torch.log(-torch.log(torch.rand(*shape, generator=g)))
    z.view(-1, shape[-1])[0], noise.view(-1, shape[-1])[0] = 1.0, 0.0  # a tie: the first option
    y, y_cost, y_soft = st_gumbel_triton(z, noise, 0.7)
    bad = z.clone()
    bad.view(-1, shape[-1])[1, 2] = float("nan")  # a NaN row: its sample is NaN, the one-hot its first NaN
    bad_y, _, _ = st_gumbel_triton(bad, noise, 0.7)
    bad_soft = soft_gumbel_sample(bad, noise, 0.7)
    assert torch.equal(bad_y, torch.zeros_like(bad_soft).scatter_(-1, bad_soft.argmax(-1, keepdim=True), 1.0))
    want_soft = soft_gumbel_sample(z, noise, 0.7)
    want_y = torch.zeros_like(want_soft).scatter_(-1, want_soft.argmax(-1, keepdim=True), 1.0)
    assert torch.equal(y, want_y) and torch.equal(y_cost, want_y)
    assert y.view(-1, shape[-1])[0, 0] == 1
    torch.testing.assert_close(y_soft, want_soft, rtol=1e-5, atol=1e-6)
    grads = [torch.randn(*shape, generator=g) for _ in range(2)]
    for got, grad in zip(st_gumbel_backward_triton(*grads, y_soft, 0.7), grads):
        torch.testing.assert_close(got, torch._softmax_backward_data(grad, want_soft, -1, torch.float32) / 0.7,
                                   rtol=1e-4, atol=1e-6)


def test_triton_straight_through_pair_is_taken_only_after_its_first_use_check(monkeypatch):
    import triroute_kernels.triton_gumbel as tg

    from megatron_triroute.routing import gumbel

    cpu = torch.device("cpu")
    assert gumbel._checked_triton(cpu) == (tg.st_gumbel_triton, tg.st_gumbel_backward_triton)
    real = tg.st_gumbel_triton
    monkeypatch.setattr(tg, "st_gumbel_triton", lambda z, *a: (lambda y, c, s: (y, 1 - c, s))(*real(z, *a)))
    with pytest.warns(UserWarning, match="straight-through sample.*values differ"):
        assert gumbel._checked_triton(cpu) is None
    monkeypatch.setattr(tg, "st_gumbel_backward_triton", lambda *a: (_ for _ in ()).throw(RuntimeError("no PTX")))
    monkeypatch.setattr(tg, "st_gumbel_triton", real)
    with pytest.warns(UserWarning, match="RuntimeError: no PTX"):
        assert gumbel._checked_triton(cpu) is None


# --- the expert gates (triton_gumbel) -------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(5, 2), (9, 1), (4, 3), (16, 4)])
def test_triton_gates_give_the_definitions_values(n, k):
    """The options (a stable descending sort's first k: a tied row takes the lowest) and the gates
    exactly, their gradient within float32 rounding; a partial block of rows."""
    from megatron_triroute.routing.gating import _gates
    from triroute_kernels.triton_gumbel import top_k_gates_backward_triton, top_k_gates_triton

    g = torch.Generator().manual_seed(n * 10 + k)
    probs = torch.randn(150, n, generator=g).softmax(-1)
    probs[0] = 1.0 / n
    grad = torch.randn(150, k, generator=g)
    option, weight, total = top_k_gates_triton(probs, k)
    want_option = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :k]
    want_weight, want_total = _gates(probs, want_option)
    assert torch.equal(option, want_option) and option[0].tolist() == list(range(k))
    assert torch.equal(weight, want_weight) and torch.equal(total, want_total)
    bad = probs.clone()
    bad[1, n - 1] = float("nan")  # a NaN sorts first, as in the stable descending sort
    bad_option = top_k_gates_triton(bad, k)[0]
    assert torch.equal(bad_option, torch.sort(bad, dim=-1, descending=True, stable=True).indices[..., :k])
    assert bad_option[1, 0] == n - 1
    want_d = torch.zeros_like(probs).scatter_(-1, want_option,
                                              (grad - (grad * want_weight).sum(-1, keepdim=True)) / want_total)
    torch.testing.assert_close(top_k_gates_backward_triton(grad, option, probs, total), want_d, rtol=1e-5, atol=1e-6)


def test_triton_gates_are_taken_only_after_their_first_use_check(monkeypatch):
    import triroute_kernels.triton_gumbel as tg

    from megatron_triroute.routing import gating

    cpu = torch.device("cpu")
    assert gating._checked_triton(cpu) == (tg.top_k_gates_triton, tg.top_k_gates_backward_triton)
    real = tg.top_k_gates_triton
    monkeypatch.setattr(tg, "top_k_gates_triton", lambda p, k: (lambda o, w, t: (o, w * 1.001, t))(*real(p, k)))
    with pytest.warns(UserWarning, match="expert gates.*values differ"):
        assert gating._checked_triton(cpu) is None
    monkeypatch.setattr(tg, "top_k_gates_triton", lambda *a: (_ for _ in ()).throw(RuntimeError("no PTX")))
    with pytest.warns(UserWarning, match="RuntimeError: no PTX"):
        assert gating._checked_triton(cpu) is None


# --- the controller's whitened heads (triton_whiten) ----------------------------------------------
@pytest.mark.parametrize("widths, accumulate", [((12, 5, 4), True), ((7,), True), ((3, 9), False)])
def test_triton_whitened_heads_give_the_definitions_values(widths, accumulate):
    """z, s and du exactly; the accumulators within float64 rounding and d gain, d bias within float32
    rounding of the definition's; u a column slice, a partial block of rows."""
    from megatron_triroute.routing.whitened_heads import heads_backward_torch, heads_torch
    from megatron_triroute.routing.whitening import RunningWhitening
    from triroute_kernels.triton_whiten import whiten_heads_backward_triton, whiten_heads_triton

    g = torch.Generator().manual_seed(sum(widths))
    heads, twins = [[RunningWhitening(d) for d in widths] for _ in range(2)]
    for m, t in zip(heads, twins):
        t.mean.copy_(m.mean.copy_(torch.randn(m.mean.shape, generator=g)))
        t.var.copy_(m.var.copy_(torch.rand(m.var.shape, generator=g) * 2 + 0.1))
        if not accumulate:
            t.eval()
    gain = [torch.rand(d, generator=g) + 0.5 for d in widths]
    bias = [torch.randn(d, generator=g) for d in widths]
    D = sum(widths)
    u = (torch.randn(70, D + 3, generator=g) * 3)[:, 1:1 + D]
    dz = torch.randn(70, D, generator=g)
    mean, denom = RunningWhitening.standardisation(heads)
    z, s = whiten_heads_triton(u, mean, denom, gain, bias, [m._acc for m in heads] if accumulate else [])
    want_z, want_s = heads_torch(twins, u, gain, bias)
    assert torch.equal(z, want_z) and torch.equal(s, want_s)
    for m, t in zip(heads, twins):
        torch.testing.assert_close(m._acc, t._acc, rtol=1e-13, atol=0.0)
        assert m._acc[0] == (70 if accumulate else 0)
    du, d_gain, d_bias = whiten_heads_backward_triton(dz, s, denom, gain)
    want_du, want_gain, want_bias = heads_backward_torch(dz, want_s, denom, gain)
    assert torch.equal(du, want_du)
    for got, want in zip([*d_gain, *d_bias], [*want_gain, *want_bias]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_whitened_heads_are_taken_only_after_their_first_use_check(monkeypatch):
    import triroute_kernels.triton_whiten as tw

    from megatron_triroute.routing import whitened_heads

    cpu = torch.device("cpu")
    assert whitened_heads._checked_triton(cpu, (5, 3)) == (tw.whiten_heads_triton, tw.whiten_heads_backward_triton)
    real = tw.whiten_heads_backward_triton
    monkeypatch.setattr(tw, "whiten_heads_backward_triton",
                        lambda *a: (lambda du, g, b: (du, [x * 1.01 for x in g], b))(*real(*a)))
    with pytest.warns(UserWarning, match="whitened heads.*values differ"):
        assert whitened_heads._checked_triton(cpu, (5, 3)) is None
    monkeypatch.setattr(tw, "whiten_heads_backward_triton", real)
    monkeypatch.setattr(tw, "whiten_heads_triton", lambda *a: (_ for _ in ()).throw(RuntimeError("no PTX")))
    with pytest.warns(UserWarning, match="RuntimeError: no PTX"):
        assert whitened_heads._checked_triton(cpu, (5, 3)) is None


def test_triton_whitening_commit_gives_the_definitions_statistics():
    """Means, variances, step counts and zeroed accumulators bit for bit (float64 arithmetic, no fused
    multiply-add), a module that saw no token kept, a module wider than one block."""
    from megatron_triroute.routing.whitening import RunningWhitening
    from tests.routing.test_running_stats import _filled_modules
    from triroute_kernels.triton_whiten import whitening_commit_triton

    got, want = _filled_modules(3)[0], _filled_modules(3)[0]
    for mods in (got, want):
        wide = RunningWhitening(300, momentum=0.9)
        wide.mean.copy_(torch.linspace(-1, 1, 300))
        rows = torch.randn(9, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        wide._acc.copy_(torch.cat([torch.tensor([9.0], dtype=torch.float64), rows.sum(0), rows.pow(2).sum(0)]))
        mods.append(wide)
    whitening_commit_triton([w._acc.clone() for w in got], [w.mean for w in got], [w.var for w in got],
                            [w.steps for w in got], [w._acc for w in got], 0.9)
    RunningWhitening.commit_torch(want, [w._acc.clone() for w in want])
    for a, b in zip(got, want):
        for name in ("mean", "var", "steps", "_acc"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert got[2].steps.item() == 2


def test_triton_whitening_commit_is_taken_only_after_its_first_use_check(monkeypatch):
    import triroute_kernels.triton_whiten as tw

    from megatron_triroute.routing import whitening

    cpu = torch.device("cpu")
    assert whitening._checked_commit(cpu) is tw.whitening_commit_triton
    real = tw.whitening_commit_triton
    monkeypatch.setattr(tw, "whitening_commit_triton", lambda r, m, v, s, a, mom: real(r, m, v, s, a, mom * 0.5))
    with pytest.warns(UserWarning, match="whitening's commit.*values differ"):
        assert whitening._checked_commit(cpu) is None


# --- the routes' sort by expert (triton_routes) ---------------------------------------------------
@pytest.mark.parametrize("shape, experts", [((700, 2), 8), ((37, 1), 3), ((5, 3), 1)])
def test_triton_routes_sort_gives_the_definitions_tensors(shape, experts):
    """order, inverse, offsets and token exactly (a stable sort), over more routes than one block."""
    from megatron_triroute.experts.routes import sort_routes_torch
    from triroute_kernels.triton_routes import sort_routes_triton

    index = torch.randint(-1, experts, shape, generator=torch.Generator().manual_seed(shape[0]))
    for a, b in zip(sort_routes_triton(index, experts), sort_routes_torch(index, experts)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_triton_routes_sort_is_taken_only_after_its_first_use_check(monkeypatch):
    import triroute_kernels.triton_routes as tr

    from megatron_triroute.experts import routes

    cpu = torch.device("cpu")
    assert routes._checked_triton(cpu) is tr.sort_routes_triton
    real = tr.sort_routes_triton
    monkeypatch.setattr(tr, "sort_routes_triton", lambda i, e: (lambda o, v, f, t: (o.flip(0), v, f, t))(*real(i, e)))
    with pytest.warns(UserWarning, match="routes' sort.*values differ"):
        assert routes._checked_triton(cpu) is None


# --- the null swap margin (triton_routes) ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triton_null_swap_margin_gives_the_definitions_values(dtype):
    """Counts and weakest experts exactly, the slope within float64 rounding, the gradient's zeros
    exactly and its values within rounding; a tie, only nulls, a partial block of tokens."""
    from megatron_triroute.routing.cost import null_swap_margin_backward_torch, null_swap_margin_torch
    from triroute_kernels.triton_routes import null_swap_margin_backward_triton, null_swap_margin_triton

    g = torch.Generator().manual_seed(4)
    z = torch.randn(3, 33, 6, generator=g, dtype=dtype)
    index = torch.randint(-1, 5, (3, 33, 2), generator=g)
    index[0, 0], index[0, 1] = torch.tensor([1, 3]), -1
    z[0, 0, 2] = z[0, 0, 4]
    got, want = null_swap_margin_triton(z, index), null_swap_margin_torch(z, index)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]) and got[2][0, 0, 0] == 2
    torch.testing.assert_close(got[1], want[1], rtol=1e-13, atol=0.0)
    grad = torch.rand(3, 33, generator=g, dtype=torch.float64)
    d_got = null_swap_margin_backward_triton(grad, want[1], want[2], 6, dtype)
    d_want = null_swap_margin_backward_torch(grad, want[1], want[2], 6, dtype)
    assert d_got.dtype == dtype and torch.equal(d_got, d_want)


def test_triton_null_swap_margin_is_taken_only_after_its_first_use_check(monkeypatch):
    import triroute_kernels.triton_routes as tr

    from megatron_triroute.routing import cost

    cpu = torch.device("cpu")
    assert cost._checked_triton(cpu) == (tr.null_swap_margin_triton, tr.null_swap_margin_backward_triton)
    real = tr.null_swap_margin_triton
    monkeypatch.setattr(tr, "null_swap_margin_triton", lambda z, i: (lambda r, s, w: (r, s, w.flip(0)))(*real(z, i)))
    with pytest.warns(UserWarning, match="null swap margin.*values differ"):
        assert cost._checked_triton(cpu) is None
