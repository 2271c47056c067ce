"""benchmarks/op_counter.py: the ops, host syncs and matmul MACs it counts, against hand counts."""

import math

import pytest
import torch
import torch.nn.functional as F
from tests.benchmarks import load_benchmark



@pytest.fixture(scope="module")
def oc():
    return load_benchmark("op_counter")


def test_counts_ops_and_host_syncs(oc):
    x = torch.arange(6.0)
    with oc.StepCounter() as counter:
        y = x * 2 + 1  # mul, add: two ops, no sync
        assert counter.ops == 2 and counter.syncs == {}
        y.sum().item()  # sum, then one scalar read
        (y > 3).nonzero()  # gt, then a data-dependent output size
    assert counter.ops == 6
    assert counter.syncs == {"aten._local_scalar_dense": 1, "aten.nonzero": 1}
    assert counter.host_syncs == 2
    assert counter.foreign_ops == {}


def test_moved_bytes_count_what_memory_bound_ops_read_and_write(oc):
    """Hand counts: operands and results of elementwise ops, an in-place op's operand twice, a
    broadcast operand once, nothing for views, allocations or matmuls."""
    x, w = torch.randn(1000), torch.randn(10, 1000)
    with oc.StepCounter() as counter:
        y = x * 2  # reads 4,000 bytes, writes 4,000
        assert counter.moved_bytes == 8000
        x.view(10, 100), x[:5], x.split(10), torch.empty(50)  # views and an allocation: nothing
        torch.mm(w, x.view(1000, 1))  # arithmetic-bound: left to the MAC counts
        assert counter.moved_bytes == 8000
        y.add_(1.0)  # read and written in place
        x.unsqueeze(0).expand(4, 1000) + y  # the broadcast operand read once, 4,000 + 4,000 + 16,000
        torch.cat([x, y])  # 8,000 read, 8,000 written
    assert counter.moved_bytes == 8000 + 8000 + 24000 + 16000


def test_counts_the_syncs_inside_ops(oc):
    """bincount reads its input's maximum back on CUDA, and a boolean mask index runs a nonzero
    inside the op: both are syncs though neither shows a sync op to the dispatcher. An integer
    index, a where and a scatter_add count (the sync-free replacements) are not."""
    x = torch.arange(6.0)
    ids = torch.tensor([0, 2, 2, 1])
    with oc.StepCounter() as counter:
        torch.bincount(ids, minlength=4)
        x[x > 2]
        y = x.clone()
        y[x > 4] = 0.0
        x[ids]
        torch.where(x > 2, x, 0.0)
        torch.zeros(4, dtype=torch.long).scatter_add_(0, ids, torch.ones_like(ids))
    assert counter.syncs == {"aten.bincount": 1, "aten.index (mask)": 2}


def test_counts_the_ops_known_to_be_slow_on_a_gpu(oc):
    """segment_reduce (CUDA's kernel ran 37 ms a call at the 160m shape) is counted by name; the
    column means that replaced it are not."""
    x = torch.rand(10, 3)
    with oc.StepCounter() as counter:
        torch.segment_reduce(x, "mean", lengths=torch.tensor([4, 6]), axis=0)
        torch.stack([part.mean(0) for part in x.split((4, 6))])
    assert counter.gpu_slow_ops == {"aten.segment_reduce": 1}


def _attention(q, k, v, times: int):
    """A decode attention over one query per (request, head) that does its work `times` times."""
    for _ in range(times):
        s = torch.einsum("bhd,bthd->bht", q, k) / math.sqrt(q.shape[-1])
        out = torch.einsum("bht,bthd->bhd", s.softmax(-1), v)
    return out


@pytest.mark.parametrize("times", [1, 2])
def test_executed_attention_macs_follow_the_work_done(oc, times):
    """Projections (by a weight, its transpose or a copy of it) count as weight MACs; the attention's
    matmuls as activation MACs, whatever they are written with: a fake attention that computes
    twice executes twice the audited 2 d per (head, key)."""
    B, T, H, d, D = 2, 7, 3, 4, 12
    g = torch.Generator().manual_seed(0)
    w = torch.randn(H * d, D, generator=g)
    x, k, v = (torch.randn(*shape, generator=g) for shape in ((B, D), (B, T, H, d), (B, T, H, d)))
    with oc.StepCounter(weights=[w]) as counter:
        q = (x @ w.T).view(B, H, d)
        q2 = x @ w.T.contiguous()  # a copy of the weight is still the weight
        out = _attention(q, k, v, times)
    assert torch.allclose(q2.view(B, H, d), q, atol=1e-5)  # two BLAS paths: rounding differs
    audited = B * H * T * 2 * d
    assert counter.weight_macs == 2 * B * D * H * d
    assert counter.activation_macs == times * audited
    assert counter.activation_macs / audited == times
    assert out.shape == (B, H, d)


def test_sdpa_counts_its_pairs(oc):
    q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 10, 8)
    with oc.StepCounter() as counter:
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    assert counter.activation_macs == 2 * 8 * 2 * 4 * 1 * 10


def test_the_decode_linear_kernel_counts_as_a_weight_matmul(oc):
    """triroute.decode_linear is a custom op, invisible inside: its M N K MACs are read from its
    shapes (as a weight's when w is one), and it is not listed as an uncounted foreign op."""
    from triroute_kernels import decode_linear

    w = torch.randn(24, 16)
    x = torch.randn(2, 16)
    with oc.StepCounter(weights=[w]) as counter:
        decode_linear(x, w)
    assert counter.foreign_ops == {} and counter.ops == 1 and counter.linear_kernels == {"triroute.decode_linear": 1}
    assert counter.weight_macs == 2 * 24 * 16 and counter.activation_macs == 0
    with oc.StepCounter() as counter:
        decode_linear(x, w)
    assert counter.activation_macs == 2 * 24 * 16 and counter.weight_macs == 0
