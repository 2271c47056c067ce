"""The decode layer's fused C++ ops (`kernels/csrc/layer_ops.cpp`): RMS norm and the Q/K/V
projections with the rotary embedding, against their definitions (the controller's op is tested
with the controller, tests/routing/test_controller.py)."""

import pytest
import torch
import torch.nn.functional as F

from benchmarks.op_counter import StepCounter
from megatron_triroute.inference.attention import apply_rope, rope_tables
from triroute_kernels import cpu_ops_available, decode_linear, rms_norm
from triroute_kernels.paged_ops import DECODE_LINEAR_ROWS


@pytest.fixture(autouse=True)
def _built():
    assert cpu_ops_available(), "the C++ kernels did not build here"


@pytest.mark.parametrize("rows", [1, 3, DECODE_LINEAR_ROWS, DECODE_LINEAR_ROWS + 1])
@pytest.mark.parametrize("d", [768, 13])
def test_rms_norm_equals_pytorchs_and_takes_the_kernel_for_a_decode_steps_rows(rows, d):
    g = torch.Generator().manual_seed(rows * d)
    x = torch.randn(rows, 1, d, generator=g) * torch.logspace(-3, 3, rows).view(rows, 1, 1)
    w = torch.randn(d, generator=g)
    with StepCounter() as counter:
        got = rms_norm(x, w, 1e-5)
    assert ("triroute.rms_norm" in counter.foreign_ops) == (rows <= DECODE_LINEAR_ROWS)
    want = F.rms_norm(x.double(), (d,), w.double(), 1e-5).float()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    assert got.shape == x.shape
    # a dtype or a weight the kernel does not take: PyTorch's
    with StepCounter() as counter:
        rms_norm(x.double(), w.double(), 1e-5)
    assert "triroute.rms_norm" not in counter.foreign_ops


def test_rms_norm_refuses_a_weight_of_another_width():
    with pytest.raises(RuntimeError, match="rms_norm: weight"):
        torch.ops.triroute.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5)
    torch.library.opcheck(torch.ops.triroute.rms_norm, (torch.randn(3, 10), torch.randn(10), 1e-6))


@pytest.mark.parametrize("rows,H,Hk,d,D", [(1, 12, 3, 64, 768), (5, 4, 2, 8, 32), (DECODE_LINEAR_ROWS, 2, 1, 6, 20)])
def test_decode_qkv_is_the_engines_projections_and_rotation_bit_for_bit(rows, H, Hk, d, D):
    g = torch.Generator().manual_seed(rows + d)
    x = torch.randn(rows, D, generator=g)
    wq, wk, wv = (torch.randn(n * d, D, generator=g) * 0.2 for n in (H, Hk, Hk))
    cos, sin = rope_tables(torch.randint(0, 5000, (rows,), generator=g), d)
    q, k, v = torch.ops.triroute.decode_qkv(x, wq, wk, wv, cos.view(rows, d), sin.view(rows, d))
    qk = apply_rope(torch.cat([decode_linear(x, wq), decode_linear(x, wk)], -1).view(rows, H + Hk, d), cos, sin)
    assert torch.equal(q, qk[:, :H]) and torch.equal(k, qk[:, H:])
    assert torch.equal(v, decode_linear(x, wv).view(rows, Hk, d))
    # and the rotation against float64 (the same rotary embedding whatever the projections' rounding)
    ref = apply_rope((x.double() @ wq.double().T).view(rows, H, d), cos.double(), sin.double())
    torch.testing.assert_close(q.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,H,Hk,d,D", [(1, 12, 3, 64, 768), (5, 4, 2, 8, 32), (DECODE_LINEAR_ROWS, 6, 3, 8, 20)])
def test_decode_qkv_with_read_flags_computes_the_flagged_heads_only(rows, H, Hk, d, D):
    """The flagged heads' Q rows bit for bit those of the whole projection, in runs of any length and
    position; the others zero, their weights not read (NaN there reaches nothing); K and V unchanged."""
    g = torch.Generator().manual_seed(rows + H)
    x = torch.randn(rows, D, generator=g)
    wq, wk, wv = (torch.randn(n * d, D, generator=g) * 0.2 for n in (H, Hk, Hk))
    cos, sin = (t.view(rows, d) for t in rope_tables(torch.randint(0, 5000, (rows,), generator=g), d))
    full = torch.ops.triroute.decode_qkv(x, wq, wk, wv, cos, sin)
    read = torch.rand(H, generator=g) < 0.5
    read[0], read[-1], read[1] = False, True, True  # a skipped first head, a run to the end
    unread = wq.clone().view(H, d, D)
    unread[~read] = float("nan")
    q, k, v = torch.ops.triroute.decode_qkv(x, unread.view(H * d, D), wk, wv, cos, sin, read)
    assert torch.equal(q[:, read], full[0][:, read])
    assert torch.equal(q[:, ~read], torch.zeros_like(q[:, ~read]))
    assert torch.equal(k, full[1]) and torch.equal(v, full[2])
    every = torch.ops.triroute.decode_qkv(x, wq, wk, wv, cos, sin, torch.ones(H, dtype=torch.bool))
    assert all(torch.equal(a, b) for a, b in zip(every, full))
    with pytest.raises(RuntimeError, match="one read flag per head"):
        torch.ops.triroute.decode_qkv(x, wq, wk, wv, cos, sin, read[:-1])


def test_decode_qkv_refuses_shapes_that_do_not_chain():
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    cos = torch.randn(2, 4)
    torch.library.opcheck(torch.ops.triroute.decode_qkv, (x, w, w[:4], w[:4], cos, cos))
    for args in ((x, w, w[:4], w[:4], torch.randn(2, 3), torch.randn(2, 3)),  # odd head width
                 (x, w, w[:4], w[:2], cos, cos),  # V unlike K
                 (x, w[:, :7].contiguous(), w[:4], w[:4], cos, cos),  # another input width
                 (x, w, w[:4], w[:4], cos[:1], cos[:1])):  # a table per row
        with pytest.raises(RuntimeError, match="decode_qkv"):
            torch.ops.triroute.decode_qkv(*args)
