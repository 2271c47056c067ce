"""The relaxed path's fast attention (`routed_attention` on `mode_attention`) and the one-pass K/V
write against the plain reference: `reference_attention` (every mode as a masked T x T attention,
K/V repeated per query head) over the per-width sum of `fake_quantize`. Values and gradients to
the backbone's q/k/v, the mode weights and the bit weights, for windows that cut, clamp (w >= T)
and degenerate (w = 0, 1), GQA groups 1/2/4 and every width."""

import pytest
import torch

from megatron_triroute.model.attention import routed_attention
from megatron_triroute.model.mode_attention import (flex_local_attention, full_attention, local_attention,
                                                   local_mode_attention, takes_flex)
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


@pytest.mark.parametrize("T,window", [(37, 5), (37, 16), (37, 0), (37, 1), (37, 36), (37, 37), (20, 100), (1, 3),
                                      (48, 5), (48, 20)])  # 48: whole query blocks, q read unpadded
@pytest.mark.parametrize("group", [1, 2, 4])
def test_fast_path_equals_reference(T, window, group):
    torch.manual_seed(T * 100 + window * 10 + group)
    B, H_kv, d = 2, 2, 8
    H = H_kv * group
    inputs = (torch.randn(B, T, H, d), torch.randn(B, T, H_kv, d) * 2, torch.randn(B, T, H_kv, d),
              torch.randn(B, T, H, N_MODES) * 2, torch.randn(B, T, len(BITS)) * 2)
    inputs = tuple(t.requires_grad_() for t in inputs)
    upstream = torch.randn(B, T, H, d)
    if T == 48:  # q as the layer passes it: a (T, B) tensor transposed, not contiguous
        inputs = (inputs[0].detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(),) + inputs[1:]
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
    outside `read_mask` (or missed inside it) changes the result: the blockwise local kernel, full
    attention and FlexAttention's local mask (forward only: it has no backward on a CPU)."""
    T, window, block = 23, 6, 4
    q = torch.zeros(1, T, 2, 4)  # equal scores: uniform weights over the keys read
    v = torch.randn(1, T, 1, 4)
    for mode, attend in ((LOCAL, lambda: local_attention(q, v, v, window, block)), (FULL, lambda: full_attention(q, v, v)),
                         (LOCAL, lambda: flex_local_attention(q, v, v, window))):
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


def test_unrouted_attention_is_the_full_attention_alone_with_no_host_read(monkeypatch):
    """modes None (attention not routed: Dense, MoE, KV-quant): the full attention, bit for bit, no
    local attention, no mode weight read back to the host."""
    from benchmarks.op_counter import StepCounter
    from megatron_triroute.model import mode_attention

    def unexpected(*args):
        raise AssertionError("local attention ran for a mode nobody reads")

    monkeypatch.setitem(mode_attention.MODE_ATTENTION, LOCAL, unexpected)
    q, k = torch.randn(1, 9, 2, 4), torch.randn(1, 9, 1, 4)
    with StepCounter() as counter:
        out = routed_attention(q, k, k, None, 3)
    assert torch.equal(out, full_attention(q, k, k)) and counter.syncs == {}, counter.syncs


def test_a_dense_models_layers_pass_no_modes_and_read_nothing_back():
    """The controller of a model without attention routing marks its all-full decision constant;
    the layer then hands the attention no modes, and its forward reads none of them back to the host
    (they were read once per mode and layer)."""
    from benchmarks.op_counter import StepCounter
    from megatron_triroute.distributed.one_process import build_model, single_process_parallel
    from megatron_triroute.systems import system_config
    from tests.model.harness import batch, tiny_triroute

    with single_process_parallel("gloo") as groups:
        for name, constant in (("dense", FULL), ("triroute", None)):
            cfg = system_config(name, tiny_triroute())
            model = build_model(cfg, groups, seed=0)
            decisions = []
            hooks = [layer.controller.register_forward_hook(lambda m, a, out: decisions.append(out.attn.constant))
                     for layer in model.decoder.layers]
            tokens, labels, idx = batch(cfg, n=2, seed=1)
            with StepCounter() as counter:
                model(tokens, idx, labels=labels)
            for h in hooks:
                h.remove()
            assert decisions == [constant] * cfg.model.n_layers
            if constant is not None:  # (Megatron-Core's cross entropy indexes by a mask: its own reads)
                assert set(counter.syncs) <= {"aten.index (mask)"}, (name, counter.syncs)


@pytest.mark.parametrize("T,window,group", [(37, 5, 2), (300, 16, 1), (20, 100, 4), (200, 0, 2), (129, 128, 2), (1, 3, 1)])
def test_flex_local_equals_the_blockwise_local(T, window, group):
    """`router.local_attention=flex` and `blocks` compute the same attention (forward on a CPU)."""
    torch.manual_seed(T + window)
    q, k, v = torch.randn(2, T, 2 * group, 8), torch.randn(2, T, 2, 8), torch.randn(2, T, 2, 8)
    torch.testing.assert_close(local_mode_attention(q, k, v, window, "flex"), local_mode_attention(q, k, v, window, "blocks"),
                               rtol=1e-5, atol=1e-5)


def test_the_default_takes_the_blocks(monkeypatch):
    from megatron_triroute.model import mode_attention

    monkeypatch.setattr(mode_attention, "flex_local_attention", lambda *a: pytest.fail("flex by default"))
    q = torch.randn(1, 9, 2, 4, requires_grad=True)
    routed_attention(q, q[:, :, :1], q[:, :, :1], torch.rand(1, 9, 2, N_MODES, requires_grad=True), 3).sum().backward()
    assert q.grad is not None


@pytest.mark.parametrize("T,block,w", [(64, 16, 32), (64, 16, 8), (37, 16, 20), (5, 5, 4), (40, 8, 0)])
def test_key_windows_are_views_of_one_copy_and_sum_their_gradients(T, block, w):
    """The local mode's key windows (B, H_kv * n, b + w, d), window h * n + i holding positions
    i*b - w .. i*b + b - 1 of kv head h (zeros past T), against windows cut one by one from a padded
    copy at every position >= 0 (before position 0 a window may read the previous head's rows: the
    mask leaves those out, so no gradient comes from them); their gradient is the sum over the
    windows that hold each key; and on a CPU they are a view of one buffer of about one copy of K,
    not a copy per window."""
    from megatron_triroute.model.mode_attention import _key_windows

    torch.manual_seed(T + w)
    B, H_kv, d = 2, 3, 4
    n = -(-T // block)
    x = torch.randn(B, T, H_kv, d, requires_grad=True)
    windows = _key_windows(x, block, w, n)
    padded = torch.cat([torch.zeros(B, w, H_kv, d), x, torch.zeros(B, n * block - T, H_kv, d)], 1)
    expected = torch.stack([padded[:, i * block:i * block + block + w, h] for h in range(H_kv) for i in range(n)], 1)
    assert windows.shape == expected.shape == (B, H_kv * n, block + w, d)
    position = (torch.arange(n).view(n, 1) * block + torch.arange(block + w) - w).repeat(H_kv, 1)  # (H_kv * n, b + w)
    kept = (position >= 0).view(1, H_kv * n, block + w, 1)
    torch.testing.assert_close(windows * kept, expected * kept, rtol=0, atol=0)
    up = torch.randn(expected.shape) * kept
    got, = torch.autograd.grad((windows * up).sum(), x)
    want, = torch.autograd.grad((expected * up).sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    rows = windows.untyped_storage().nbytes() // (d * windows.element_size())
    assert rows == B * (w + H_kv * n * block)  # one copy of x, padded; no per-window copy


@pytest.mark.parametrize("T,block,w", [(64, 16, 32), (64, 16, 8), (37, 16, 20), (5, 5, 4), (40, 8, 0), (32, 4, 20)])
@pytest.mark.parametrize("index_add", [True, False])
@pytest.mark.parametrize("parts", [1, 2])
def test_window_gradients_sum_over_the_windows_that_read_each_key(T, block, w, index_add, parts, monkeypatch):
    """The windows' backward in both its forms (`index_add_` on a CPU; `unfold_backward`, a GPU's,
    taken here on the CPU) against a loop over the windows, on a non-contiguous gradient as SDPA
    gives, zero at the rows before each head's first position (what the mask guarantees, next test);
    with the heads' windows returned whole or as two parts (K's and V's), each with its gradient."""
    from megatron_triroute.model import mode_attention
    from megatron_triroute.model.mode_attention import _KeyWindows

    sum_windows = mode_attention._sum_windows
    monkeypatch.setattr(mode_attention, "_sum_windows", lambda gs, rows, block, _: sum_windows(gs, rows, block, index_add))

    torch.manual_seed(T + w)
    B, H_kv, d = 2, 3 * parts, 4
    n = -(-T // block)
    x = torch.randn(B, T, H_kv, d, requires_grad=True)
    position = torch.arange(n).view(n, 1) * block + torch.arange(block + w) - w  # (n, b + w)
    grad = torch.randn(B, block + w, H_kv * n, d).transpose(1, 2)  # (B, H_kv n, b + w, d), not contiguous
    grad = grad * (position >= 0).repeat(H_kv, 1).view(1, H_kv * n, block + w, 1)
    got, = torch.autograd.grad(_KeyWindows.apply(x, block, w, n, parts), x, grad.chunk(parts, 1))
    want = torch.zeros(B, w + n * block, H_kv, d)  # w rows in front of each head's positions
    for h in range(H_kv):
        for i in range(n):  # window i reads rows i*b .. i*b + b + w - 1 of its head's
            want[:, i * block:i * block + block + w, h] += grad[:, h * n + i]
    torch.testing.assert_close(got, want[:, w:w + T], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T,window,group", [(37, 5, 2), (64, 20, 1), (20, 100, 4)])
def test_keys_before_a_heads_first_position_take_exactly_zero_gradient(T, window, group):
    """What the windows' backward relies on: a window's rows before its kv head's first position
    (the previous head's last positions, or the zeros in front) are masked out, so SDPA gives them a
    gradient of exactly 0, whatever the upstream gradient."""
    from megatron_triroute.model import mode_attention

    torch.manual_seed(T + window)
    q = torch.randn(2, T, 2 * group, 8, requires_grad=True)
    k, v = (torch.randn(2, T, 2, 8, requires_grad=True) for _ in range(2))
    grads, key_windows = [], mode_attention._key_windows

    def hooked(x, block, w, n):
        windows = key_windows(x, block, w, n)
        windows.register_hook(grads.append)
        return windows

    mode_attention._key_windows = hooked
    try:
        (mode_attention.local_attention(q, k, v, window) * torch.randn(2, T, 2 * group, 8)).sum().backward()
    finally:
        mode_attention._key_windows = key_windows
    block = min(mode_attention.LOCAL_QUERY_BLOCK, T)
    n, w = -(-T // block), min(window, T - 1)
    before = (torch.arange(n).view(n, 1) * block + torch.arange(block + w) - w < 0).repeat(2, 1)  # (H_kv n, b + w)
    assert len(grads) == 2 and before.any()
    for g in grads:
        assert g[:, before].abs().max() == 0 and g[:, ~before].abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_flex_local_values_and_gradients_equal_the_blocks(dtype):
    """FlexAttention's compiled kernel against the blockwise SDPA path at a training shape, forward
    and backward (q, k, v), with GQA and a window that cuts."""
    torch.manual_seed(0)
    B, T, H_kv, G, d, window = 2, 1024, 2, 4, 64, 128
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
    q, k, v = make(B, T, H_kv * G, d), make(B, T, H_kv, d), make(B, T, H_kv, d)
    up = torch.randn(B, T, H_kv * G, d, device="cuda", dtype=dtype)
    assert takes_flex("auto", q) and not takes_flex("auto", q[..., :8])  # auto: flex here, not at d_head 8
    results = {}
    for local in ("flex", "blocks"):
        out = local_mode_attention(q, k, v, window, local)
        results[local] = (out, *torch.autograd.grad((out * up).sum(), (q, k, v)))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for a, b in zip(results["flex"], results["blocks"]):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_local_attention_setting_names_its_choices():
    from megatron_triroute.config import ConfigError
    from tests.routing.helpers import tiny_config

    assert tiny_config().router.local_attention == "auto"
    with pytest.raises(ConfigError, match="local_attention.*auto, blocks, flex"):
        tiny_config(local_attention="fused")


def test_auto_takes_the_blocks_on_a_cpu_and_flex_takes_flex_anywhere():
    """`auto` chooses flex only for a CUDA tensor at d_head >= 16 (the CUDA side is checked by the
    gpu-marked test above); on a CPU it is the blocks, value for value."""
    q = torch.randn(1, 40, 4, 16)
    k, v = torch.randn(1, 40, 2, 16), torch.randn(1, 40, 2, 16)
    assert not takes_flex("auto", q) and not takes_flex("blocks", q) and takes_flex("flex", q)
    assert torch.equal(local_mode_attention(q, k, v, 8, "auto"), local_mode_attention(q, k, v, 8, "blocks"))


def _mix_chain(modes, terms):
    """The relaxed mix as autograd's own chain of selects, casts, products and sums."""
    out = None
    for m, a in terms.items():
        term = modes[..., m, None].to(a.dtype) * a
        out = term if out is None else out + term
    return out


@pytest.mark.parametrize("soft", [False, True])
def test_mode_mix_node_equals_the_chain_with_fewer_ops(soft):
    """`ModeMix` against the chain it stands for: the same values (bit for bit on straight-through
    one-hots, within rounding on soft weights) and gradients to each mode's attention, the
    gradient to the modes within rounding (summed in another order where a kernel runs), in fewer
    dispatched ops forward and backward (tests/model/test_mode_mix.py counts the kernels' calls)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from megatron_triroute.model.mode_mix import ModeMix
    from megatron_triroute.routing.modes import READING_MODES

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 9, 4, N_MODES, generator=g, requires_grad=True)
    attn = [torch.randn(2, 9, 4, 8, generator=g, requires_grad=True) for _ in READING_MODES]
    upstream = torch.randn(2, 9, 4, 8, generator=g)
    results = []
    for mix in (lambda m: ModeMix.apply(m, *attn), lambda m: _mix_chain(m, dict(zip(READING_MODES, attn)))):
        modes = logits.softmax(-1) if soft else st_gumbel_softmax(logits, 1.0, noise=torch.zeros_like(logits))
        Count.n = 0
        with Count():
            out = mix(modes)
            grads = torch.autograd.grad((out * upstream).sum(), [modes, *attn])
        results.append((out, grads, Count.n))
    (ours, d_ours, n_ours), (chain, d_chain, n_chain) = results
    if soft:
        torch.testing.assert_close(ours, chain, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(ours, chain)
    torch.testing.assert_close(d_ours[0], d_chain[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(d_ours[1:], d_chain[1:]):
        assert torch.equal(a, b)
    assert d_ours[0][..., 0].abs().sum() == 0 and d_ours[0][..., 1:].abs().sum() > 0  # SKIP reads nothing
    assert n_ours + 5 <= n_chain, (n_ours, n_chain)  # 17 against 23 with the product and sum around them


@pytest.mark.parametrize("T,window,H_kv,G", [(48, 20, 2, 2), (37, 5, 3, 4), (37, 40, 1, 3), (9, 0, 2, 1)])
def test_key_and_value_windows_from_one_tensor_equal_the_separate_ones(T, window, H_kv, G):
    """K and V given as the two halves of one tensor (as the layer writes them) take their windows
    from one buffer (`_KeyWindows` with two parts): the same local attention, bit for bit, and the same gradients to
    q and to that tensor as K and V given apart."""
    from megatron_triroute.model.mode_attention import _KeyWindows, stacked_kv

    g = torch.Generator().manual_seed(T + window + H_kv)
    q = torch.randn(2, T, H_kv * G, 8, generator=g, requires_grad=True)
    kv = torch.randn(2, T, 2 * H_kv, 8, generator=g, requires_grad=True)
    upstream = torch.randn(2, T, H_kv * G, 8, generator=g)
    calls = []  # per call of the windows' node: how many tensors' windows it made from its buffer
    apply = _KeyWindows.apply
    results = []
    for together in (True, False):
        k, v = kv.chunk(2, dim=2) if together else (kv[:, :, :H_kv].clone(), kv[:, :, H_kv:].clone())
        assert (stacked_kv(k, v) is kv) == together
        _KeyWindows.apply = lambda *a: (calls.append(a[-1]), apply(*a))[1]
        try:
            out = local_attention(q, k, v, window)
        finally:
            _KeyWindows.apply = apply
        results.append((out, *torch.autograd.grad((out * upstream).sum(), (q, kv))))
    assert calls == [2, 1, 1]  # the one-buffer path ran for the halves only, once for both
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_stacked_kv_takes_only_the_two_halves_in_order():
    from megatron_triroute.model.mode_attention import stacked_kv

    kv = torch.randn(2, 5, 4, 8)
    k, v = kv.chunk(2, dim=2)
    assert stacked_kv(k, v) is kv
    assert stacked_kv(v, k) is None  # V's heads first
    assert stacked_kv(k, k) is None
    a, b = torch.randn(2, 5, 6, 8).split([2, 4], dim=2)
    assert stacked_kv(a, b) is None  # unequal halves
    c, e = torch.randn(2, 5, 4, 8).chunk(2, dim=3)
    assert stacked_kv(c, e) is None  # split along the head dim, not the heads
    x = torch.randn(2, 5, 6, 8)
    assert stacked_kv(x[:, :, :2], x[:, :, 2:4]) is None  # the first two thirds, not halves


def test_stacked_kv_refuses_a_base_autograd_does_not_track():
    """An autograd function whose output is a view of a tensor made in its forward: the halves' base
    is that tensor, which tracks no gradient, so taking the windows from it would lose K's and V's
    gradients: refused (the layer's write returns a tensor of its own, whose halves are taken)."""
    from megatron_triroute.model.mode_attention import stacked_kv
    from megatron_triroute.routing.quant import relaxed_kv_write

    class ViewOut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return (x * 2).view(x.shape)

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    x = torch.randn(2, 5, 4, 8, requires_grad=True)
    k, v = ViewOut.apply(x).chunk(2, dim=2)
    assert k._base is not None and not k._base.requires_grad
    assert stacked_kv(k, v) is None
    y = torch.zeros(2, 5, 4)
    y[..., 2] = 1
    written = relaxed_kv_write(x, y.requires_grad_(), (2, 4, 8, 16), 8)
    assert stacked_kv(*written.chunk(2, dim=2)) is written
