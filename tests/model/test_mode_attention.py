"""The relaxed path's fast attention (`routed_attention` on `mode_attention`) and the one-pass K/V
write against the plain reference: `reference_attention` (every mode as a masked T x T attention,
K/V repeated per query head) over the per-width sum of `fake_quantize`. Values and gradients to
the backbone's q/k/v, the mode weights and the bit weights, for windows that cut, clamp (w >= T)
and degenerate (w = 0, 1), GQA groups 1/2/4 and every width."""

import pytest
import torch

from megatron_triroute.model.attention import routed_attention
from megatron_triroute.model.mode_attention import full_attention, local_attention
from megatron_triroute.routing.gumbel import st_gumbel_softmax
from megatron_triroute.routing.modes import FULL, LOCAL, N_MODES, read_mask
from megatron_triroute.routing.quant import fake_quantize, relaxed_kv_write
from tests.oracles import reference_attention

BITS = (2, 4, 8, 16)


def _per_width_write(x, y):
    """The write as Alg. 1 states it: sum_b y[b] * Q_b(x), one fake-quantiser per width."""
    out = torch.zeros_like(x)
    for i, b in enumerate(BITS):
        out = out + y[..., i, None, None] * fake_quantize(x, b, 4)
    return out


def _step(attend, write, inputs, upstream, window):
    q, k, v, mode_logits, bit_logits = inputs
    modes = st_gumbel_softmax(mode_logits, 1.0, noise=torch.zeros_like(mode_logits))
    bits = st_gumbel_softmax(bit_logits, 1.0, noise=torch.zeros_like(bit_logits))
    out = attend(q, write(k, bits), write(v, bits), modes, window)
    grads = torch.autograd.grad((out * upstream).sum(), inputs)
    return (out,) + grads


@pytest.mark.parametrize("T,window", [(37, 5), (37, 16), (37, 0), (37, 1), (37, 36), (37, 37), (20, 100), (1, 3)])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_fast_path_equals_reference(T, window, group):
    torch.manual_seed(T * 100 + window * 10 + group)
    B, H_kv, d = 2, 2, 8
    H = H_kv * group
    inputs = (torch.randn(B, T, H, d), torch.randn(B, T, H_kv, d) * 2, torch.randn(B, T, H_kv, d),
              torch.randn(B, T, H, N_MODES) * 2, torch.randn(B, T, len(BITS)) * 2)
    inputs = tuple(t.requires_grad_() for t in inputs)
    upstream = torch.randn(B, T, H, d)
    fast = _step(routed_attention, lambda x, y: relaxed_kv_write(x, y, BITS, 4), inputs, upstream, window)
    ref = _step(reference_attention, _per_width_write, inputs, upstream, window)
    if T > 8:  # every mode and every width is taken somewhere
        assert set(inputs[3].argmax(-1).unique().tolist()) == set(range(N_MODES))
        assert set(inputs[4].argmax(-1).unique().tolist()) == set(range(len(BITS)))
    for name, a, b in zip(("out", "q", "k", "v", "mode logits", "bit logits"), fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert fast[4].abs().sum() > 0 and fast[5].abs().sum() > 0  # the heads do receive gradient


def test_each_mode_reads_exactly_its_range():
    """One-hot values: a query's output is the mean of the values it reads, so any key read
    outside `read_mask` (or missed inside it) changes the result."""
    T, window, block = 23, 6, 4
    q = torch.zeros(1, T, 2, 4)  # equal scores: uniform weights over the keys read
    v = torch.randn(1, T, 1, 4)
    for mode, attend in ((LOCAL, lambda: local_attention(q, v, v, window, block)), (FULL, lambda: full_attention(q, v, v))):
        mask = read_mask(T, mode, window).float()
        expected = (mask / mask.sum(-1, keepdim=True)) @ v[0, :, 0]  # (T, 4)
        out = attend()
        torch.testing.assert_close(out[0, :, 0], expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[0, :, 1], expected, rtol=1e-6, atol=1e-6)


def test_mode_nobody_reads_without_gradient_is_skipped(monkeypatch):
    """A dense model's constant all-full modes never run the local attention."""
    from megatron_triroute.model import mode_attention

    def unexpected(*args):
        raise AssertionError("local attention ran for a mode nobody reads")

    monkeypatch.setitem(mode_attention.MODE_ATTENTION, LOCAL, unexpected)
    q, k = torch.randn(1, 9, 2, 4), torch.randn(1, 9, 1, 4)
    full = torch.zeros(1, 9, 2, N_MODES)
    full[..., FULL] = 1.0
    torch.testing.assert_close(routed_attention(q, k, k, full, 0), full_attention(q, k, k))
    full.requires_grad_()  # a mode weight that needs its gradient runs even if nobody reads it
    with pytest.raises(AssertionError, match="local attention ran"):
        routed_attention(q, k, k, full, 0)
