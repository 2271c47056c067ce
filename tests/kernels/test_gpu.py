"""Triton kernels on a real CUDA GPU against the torch twins (skipped on CPU machines)."""

import math

import pytest
import torch

from megatron_triroute.routing.quant import dequantize_groups, quantize_groups
from triroute_kernels import (
    allocate_kv_pools,
    choose_backend,
    decode_attention_pool,
    decode_attention_pool_torch,
    dequantize_slots,
    quantize_pack_into,
    quantize_pack_into_torch,
)

pytestmark = pytest.mark.gpu


def test_auto_dispatch_picks_triton_on_cuda():
    pytest.importorskip("triton")
    assert choose_backend(torch.device("cuda")) == "triton"


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_gpu_write_bit_exact_and_attention_matches_torch(bits):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(bits)
    B, H_kv, G, d, g, P = 8, 4, 4, 128, 32, 16
    lengths = [1, 15, 16, 17, 300, 511, 64, 1000]
    need = [math.ceil(n / P) for n in lengths]
    n_pages = sum(need) + 5
    dev = torch.device("cuda")
    k_pool, v_pool = allocate_kv_pools(bits, n_pages, P, H_kv, d, g, dev)
    k_ref, v_ref = allocate_kv_pools(bits, n_pages, P, H_kv, d, g, dev)
    perm = torch.randperm(n_pages, generator=gen).tolist()
    table = torch.full((B, max(need)), -1, dtype=torch.int32)
    xs = []
    for b, n in enumerate(lengths):
        pages = [perm.pop() for _ in range(need[b])]
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        slots = torch.tensor([pages[i // P] * P + i % P for i in range(n)], device=dev)
        k = (torch.randn(n, H_kv, d, generator=gen) * 2).to(dev)
        v = torch.randn(n, H_kv, d, generator=gen).to(dev)
        for x, pool, ref in ((k, k_pool, k_ref), (v, v_pool, v_ref)):
            quantize_pack_into(x, bits, g, pool, slots)  # auto: Triton on CUDA
            quantize_pack_into_torch(x, bits, g, ref, slots)
        k_pool.token_pos.view(-1)[slots] = torch.arange(n, dtype=torch.int32, device=dev)
        xs.append((slots, k))
    for a, r in zip(k_pool.storage_tensors() + v_pool.storage_tensors(), k_ref.storage_tensors() + v_ref.storage_tensors()):
        assert torch.equal(a, r)
    slots, k = xs[-1]
    got = dequantize_slots(k_pool, torch.arange(n_pages, device=dev)).reshape(-1, H_kv, d)[slots]
    want = k.half().float() if bits == 16 else dequantize_groups(*quantize_groups(k, bits, g))
    assert torch.equal(got, want)
    q = torch.randn(B, H_kv * G, d, generator=gen).to(dev)
    hi = torch.tensor(lengths, dtype=torch.int32, device=dev) - 1
    lo = torch.randint(0, 1200, (B, H_kv * G), generator=gen, dtype=torch.int32).to(dev)
    lo[:, 0] = 0  # full
    lo[:, 1] = hi + 1  # skip
    table = table.to(dev)
    out, lse = decode_attention_pool(q, k_pool, v_pool, bits, g, table, lo, hi, d**-0.5)
    r_out, r_lse = decode_attention_pool_torch(q, k_pool, v_pool, bits, g, table, lo, hi, d**-0.5)
    assert torch.allclose(out, r_out, atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))
    fin = torch.isfinite(r_lse)
    assert torch.allclose(lse[fin], r_lse[fin], atol=1e-4, rtol=1e-4)
    assert (lse[:, 1] == -math.inf).all()


def test_paged_attention_on_cuda_is_one_triton_launch_equal_to_the_cpu_op():
    """The engine's attention op on CUDA (all pools in one Triton launch) against the same op on the
    CPU (the C++ kernel, or its twin) over the same mixed-width pools: output and counters."""
    pytest.importorskip("triton")
    import dataclasses

    from tests.kernels.scenario import mixed_pools
    from triroute_kernels import PoolLists, paged_attention

    gen = torch.Generator().manual_seed(3)
    H_kv, G, d, g, P = 3, 4, 64, 32, 16
    lengths = [1, 16, 17, 700, 2100, 64]
    stores, tables = mixed_pools(lengths, H_kv, P, gen, (2, 4, 8, 16), d, g)
    N, H = len(lengths), H_kv * G
    hi = torch.tensor(lengths) - 1
    modes = torch.randint(0, 3, (N, H), generator=gen)
    lo = torch.where(modes == 0, 0, (hi.view(N, 1) - 128).clamp_min(0))
    lo = torch.where(modes == 2, hi.view(N, 1) + 1, lo)
    q = torch.randn(N, H, d, generator=gen)
    request = torch.arange(N)

    def on(dev):
        def move(pool):
            return dataclasses.replace(pool, **{f.name: getattr(pool, f.name).to(dev) for f in dataclasses.fields(pool)
                                                if isinstance(getattr(pool, f.name), torch.Tensor)})
        return PoolLists.of([move(s.k_pool) for s in stores], [move(s.v_pool) for s in stores])

    c_cpu, c_gpu = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long, device="cuda")
    want = paged_attention(q, on("cpu"), tables, request, lo, hi, d**-0.5, c_cpu)
    got = paged_attention(q.cuda(), on("cuda"), tables.cuda(), request.cuda(), lo.cuda(), hi.cuda(), d**-0.5, c_gpu)
    assert torch.allclose(got.cpu(), want, atol=1e-4, rtol=1e-4), (got.cpu() - want).abs().max()
    assert torch.equal(c_gpu.cpu(), c_cpu)


def test_cache_append_on_cuda_is_one_triton_launch_equal_to_the_cpu_op():
    """A decode step's append on CUDA (every pool in one Triton launch, no read back, under CUDA's
    sync check) against the same op on the CPU: pools bit for bit, positions, counts."""
    pytest.importorskip("triton")
    from tests.kernels.test_paged_ops import GS, WIDTHS, D, _decode_state, _fresh_pools
    from triroute_kernels import PoolLists, cache_append

    gen = torch.Generator().manual_seed(24)
    H_kv, P, R, width = 3, 16, 40, 4
    pages = R * width + 2
    counts, tables = _decode_state(R, pages, P, width, gen)
    rows = torch.randperm(R, generator=gen)[:32]
    option = torch.randint(0, 4, (32,), generator=gen)
    k, v = torch.randn(32, H_kv, D, generator=gen) * 3, torch.randn(32, H_kv, D, generator=gen)
    positions = torch.randint(0, 10_000, (32,), generator=gen)
    cpu = _fresh_pools(H_kv, P, pages)
    c_cpu = counts.clone()
    cache_append(k, v, option, rows, positions, c_cpu, tables, P, PoolLists.of(*cpu))
    pairs = [allocate_kv_pools(b, pages, P, H_kv, D, GS, device="cuda") for b in WIDTHS]
    gpu = [[kp for kp, _ in pairs], [vp for _, vp in pairs]]
    c_gpu, lost = counts.cuda(), torch.zeros(1, dtype=torch.long, device="cuda")
    args = [t.cuda() for t in (k, v, option, rows, positions)]
    tables_gpu, pools_gpu = tables.cuda(), PoolLists.of(*gpu)  # a copy from the host waits: made before the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        cache_append(*args, c_gpu, tables_gpu, P, pools_gpu, lost)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(c_gpu.cpu(), c_cpu) and lost.item() == 0
    for a, b in zip(gpu[0] + gpu[1], cpu[0] + cpu[1]):
        assert torch.equal(a.token_pos.cpu(), b.token_pos), a.bits
        assert all(torch.equal(ta.cpu(), tb) for ta, tb in zip(a.storage_tensors(), b.storage_tensors())), a.bits


def test_gpu_noise_hash_takes_triton_and_equals_the_cpu_chain():
    pytest.importorskip("triton")
    from megatron_triroute.routing import noise

    gen = torch.Generator().manual_seed(0)
    words = lambda *shape: torch.randint(0, 2**32, shape, generator=gen, dtype=torch.int64)  # noqa: E731
    args = (words(2), words(8), words(8, 1000), noise.counter_words(36, "cpu"))
    assert noise._hash_kernel(torch.device("cuda")) is not None  # its first-use check passed
    on_gpu = noise.counter_uniform(*(a.cuda() for a in args))
    assert torch.equal(on_gpu.cpu(), noise.counter_uniform_torch(*args))
    keys = words(4, 2048)
    assert noise._words_kernel(torch.device("cuda")) is not None
    for field in (4, 5):
        assert torch.equal(noise.chain_words(keys.cuda(), field).cpu(), noise.chain_words_torch(keys, field))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_relaxed_write_values_take_triton_and_equal_the_cpu_chain(dtype):
    """The relaxed K/V write's values at a 160m layout (3 KV heads of 64, groups of 32): the Triton
    kernel passes its first-use check and gives the CPU chain's values bit for bit."""
    pytest.importorskip("triton")
    from megatron_triroute.routing import quant

    bits, group = (2, 4, 8, 16), 32
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 512, 3, 64, generator=gen) * torch.logspace(-2, 2, 512).view(1, 512, 1, 1)).to(dtype)
    x[0, 0, 0, :group] = 0.5  # a constant group
    on_gpu = x.cuda()
    assert quant._triton_values(on_gpu, bits, group) is not None  # its first-use check passed
    assert torch.equal(quant.quantized_values(on_gpu, bits, group).cpu(), quant.quantized_values_torch(x, bits, group))
