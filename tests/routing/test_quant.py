import torch

from megatron_triroute.routing.quant import fake_quantize, kv_bits_per_token, quantize_groups, relaxed_kv_write
from tests.oracles import pack_kv, unpack_kv


def test_q_b_hand_computation():
    # One head, one group of 4: min 0, max 3 -> 2 bits: s = 3 / 3 = 1, z = 0.
    x = torch.tensor([[[0.0, 0.4, 1.6, 3.0]]])
    assert torch.equal(fake_quantize(x, 2, 4), torch.tensor([[[0.0, 0.0, 2.0, 3.0]]]))
    # 1 bit-equivalent levels of a shifted group: min -1, max 2, 2 bits -> s = 1, z = -1.
    y = torch.tensor([[[-1.0, -0.2, 0.49, 2.0]]])
    assert torch.equal(fake_quantize(y, 2, 4), torch.tensor([[[-1.0, 0.0, 0.0, 2.0]]]))
    # 16 bits is the float16 cache format: values round to float16, the gradient is the identity.
    y16 = y.clone().requires_grad_(True)
    q16 = fake_quantize(y16, 16, 4)
    assert torch.equal(q16, y.half().float())
    assert not torch.equal(q16, y)  # -0.2 and 0.49 are not float16 numbers
    q16.sum().backward()
    assert torch.equal(y16.grad, torch.ones_like(y))


def test_constant_group_dequantises_exactly():
    x = torch.full((1, 1, 4), 0.25)
    assert torch.equal(fake_quantize(x, 2, 4), x)


def test_groups_never_span_heads():
    # Head 0 has a tiny range, head 1 a huge one; per-head groups keep head 0 accurate.
    x = torch.tensor([[[0.0, 0.1, 0.2, 0.3], [0.0, 100.0, 200.0, 300.0]]])
    q = fake_quantize(x, 2, 4)
    assert torch.allclose(q[0, 0], torch.tensor([0.0, 0.1, 0.2, 0.3]), atol=1e-3)
    codes, scale, zero = quantize_groups(x, 2, 4)
    assert scale.shape == (1, 2, 1)
    assert torch.allclose(scale.float().squeeze(), torch.tensor([0.1, 100.0]), rtol=1e-3)


def test_straight_through_gradient_is_identity():
    x = torch.randn(3, 2, 8, requires_grad=True)
    (fake_quantize(x, 4, 4) * torch.arange(48.0).view(3, 2, 8)).sum().backward()
    assert torch.equal(x.grad, torch.arange(48.0).view(3, 2, 8))


def test_relaxed_write_value_and_bit_head_gradient():
    x = torch.randn(2, 3, 2, 8)
    w = torch.zeros(2, 3, 4)
    w[..., 1] = 1.0  # all tokens at 4 bits
    w.requires_grad_(True)
    out = relaxed_kv_write(x, w, (2, 4, 8, 16), 4)
    assert torch.equal(out, fake_quantize(x, 4, 4))
    up = torch.randn_like(out)
    (out * up).sum().backward()
    for i, b in enumerate((2, 4, 8, 16)):
        expected = (up * fake_quantize(x, b, 4)).sum(dim=(-1, -2))
        assert torch.allclose(w.grad[..., i], expected, atol=1e-5)


def test_packed_bytes_equal_accounted_bits_and_round_trip():
    torch.manual_seed(0)
    n_tok, h_kv, d_h, g = 6, 2, 8, 4
    k, v = torch.randn(n_tok, h_kv, d_h), torch.randn(n_tok, h_kv, d_h)
    for bits in (2, 4, 8, 16):
        pk, pv = pack_kv(k, bits, g), pack_kv(v, bits, g)
        assert (pk.nbytes + pv.nbytes) * 8 == n_tok * kv_bits_per_token(bits, h_kv * d_h, g)
        expected = fake_quantize(k, bits, g)
        assert torch.equal(unpack_kv(pk), expected)


def test_bits_per_token_hand_values():
    # d_kv = 16, group 4: 8 groups (4 for K, 4 for V) x 32 bits of metadata.
    assert kv_bits_per_token(2, 16, 4) == 2 * 16 * 2 + 8 * 32
    assert kv_bits_per_token(8, 16, 4) == 2 * 16 * 8 + 8 * 32
    assert kv_bits_per_token(16, 16, 4) == 2 * 16 * 16


def test_relaxed_write_equals_the_per_width_sum_bit_for_bit():
    """The shared-range, no-autograd write gives exactly sum_b y_ST[b] * fake_quantize(x, b): the
    same forward bits and the same gradients to x and to the bit weights."""
    from megatron_triroute.routing.gumbel import st_gumbel_softmax

    torch.manual_seed(3)
    bits = (2, 4, 8, 16)
    x = (torch.randn(2, 5, 2, 8) * 3).requires_grad_()
    logits = torch.randn(2, 5, len(bits), requires_grad=True)
    upstream = torch.randn(2, 5, 2, 8)

    def reference(x, y):
        out = torch.zeros_like(x)
        for i, b in enumerate(bits):
            out = out + y[..., i, None, None] * fake_quantize(x, b, 4)
        return out

    results = []
    for write in (relaxed_kv_write, lambda x, y, *_: reference(x, y)):
        x.grad = logits.grad = None
        y = st_gumbel_softmax(logits, 1.0, noise=torch.zeros_like(logits))
        out = write(x, y, bits, 4)
        (out * upstream).sum().backward()
        results.append((out.detach(), x.grad.clone(), logits.grad.clone()))
    (out_new, gx_new, gl_new), (out_ref, gx_ref, gl_ref) = results
    assert torch.equal(out_new, out_ref)
    assert torch.equal(gx_new, gx_ref) and torch.equal(gx_new, upstream)
    torch.testing.assert_close(gl_new, gl_ref, rtol=1e-6, atol=1e-6)
    assert gl_new.abs().sum() > 0


def test_one_pass_quantiser_is_bit_exact_at_every_width():
    """`quantized_values` quantises all widths together; each slice must equal `fake_quantize`
    bit for bit, in float32 and bfloat16, on constant groups, tiny and huge ranges."""
    from megatron_triroute.routing.quant import quantized_values

    torch.manual_seed(5)
    bits = (2, 4, 8, 16)
    x = torch.randn(8, 6, 16, 32) * torch.logspace(-6, 4, 6).view(1, 6, 1, 1)  # within float16 range
    x[0, 0, 0, :4] = 0.3  # a constant group
    x[1, 2, 1] = 7.0  # a constant head
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        values = quantized_values(xd, bits, 4)
        assert values.shape == (8, 6, len(bits), 16 * 32) and values.dtype == dtype
        for i, b in enumerate(bits):
            assert torch.equal(values[:, :, i].view_as(xd), fake_quantize(xd, b, 4)), (dtype, b)
    # a subset of the widths, in the config's order, and 16 alone (the uniform-width systems)
    assert torch.equal(quantized_values(x, (4,), 4).view_as(x), fake_quantize(x, 4, 4))
    assert torch.equal(quantized_values(x, (16,), 4).view_as(x), fake_quantize(x, 16, 4))
    # widths in any order: the quantised ones after 16, or apart from each other
    for order in ((16, 8, 2), (2, 16, 8)):
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            values = quantized_values(xd, order, 4)
            for i, b in enumerate(order):
                assert torch.equal(values[:, :, i].view_as(xd), fake_quantize(xd, b, 4)), (order, dtype, b)


def test_the_cpu_kernel_equals_the_tensor_chain_bit_for_bit_and_is_what_float32_takes():
    """`torch.ops.triroute.quantized_values` (C++, where built) and `quantized_values_torch`: the same
    bits at every width and order, for group sizes with and without a vector remainder, constant
    groups, rounding ties and ranges from 1e-6 to 1e4, on a non-contiguous input, and for NaN and
    infinite values; a float32 CPU tensor goes through the kernel, any other dtype through the chain."""
    from triroute_kernels import cpu_ops_available

    from benchmarks.op_counter import StepCounter
    from megatron_triroute.routing.quant import quantized_values, quantized_values_torch

    assert cpu_ops_available(), "the C++ kernels did not build here"
    torch.manual_seed(7)
    for shape, group in (((4, 6, 2, 32), 32), ((4, 6, 2, 32), 8), ((3, 5, 1, 12), 12), ((2, 3, 3, 20), 4)):
        x = torch.randn(shape) * torch.logspace(-6, 4, shape[1]).view(1, -1, 1, 1)
        x[0, 0, 0, :group] = 0.3  # a constant group
        x[0, 1, 0, :group] = torch.arange(group) * 0.5  # codes on rounding ties
        x = x.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous
        for bits in ((2, 4, 8, 16), (16,), (4,), (8, 2), (16, 2)):
            kernel = torch.ops.triroute.quantized_values(x, list(bits), group)
            assert torch.equal(kernel, quantized_values_torch(x, bits, group)), (shape, group, bits)

    # non-finite K/V: a NaN makes its group NaN at every width below 16, never a number (a corrupt value
    # must not pass as a quantised one); infinities as the chain gives them
    for group in (8, 4, 12):
        x = torch.randn(2, 3, 1, 24)
        x[0, 0, 0, 3], x[0, 1, 0, 5], x[0, 2, 0, 1], x[1, 0, 0, 20] = float("nan"), float("inf"), -float("inf"), 1e6
        kernel = torch.ops.triroute.quantized_values(x, [2, 4, 16], group)
        chain = quantized_values_torch(x, (2, 4, 16), group)
        assert torch.equal(kernel.isnan(), chain.isnan()) and torch.equal(kernel.nan_to_num(), chain.nan_to_num())
        assert kernel[0, 0, :2, :group].isnan().all(), group  # the NaN's group, at 2 and 4 bits

    for dtype, via_kernel in ((torch.float32, True), (torch.float64, False), (torch.bfloat16, False)):
        with StepCounter() as counter:
            quantized_values(torch.randn(2, 3, 1, 8, dtype=dtype), (2, 16), 4)
        assert ("triroute.quantized_values" in counter.foreign_ops) == via_kernel, (dtype, counter.foreign_ops)


def test_relaxed_write_keeps_its_values_under_autocast():
    """Under bf16 autocast (the trainer's --bf16) the width mix must not round fp32 K/V to bf16."""
    torch.manual_seed(6)
    bits = (2, 4, 8, 16)
    x = torch.randn(2, 5, 2, 8)
    w = torch.nn.functional.one_hot(torch.arange(10).view(2, 5) % len(bits), len(bits)).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = relaxed_kv_write(x, w, bits, 4)
    assert out.dtype == torch.float32
    for i, b in enumerate(bits):
        chosen = w[..., i] > 0
        assert torch.equal(out[chosen], fake_quantize(x, b, 4)[chosen]), b


def _written_case(soft: bool, widths: int = 4):
    g = torch.Generator().manual_seed(3 + soft)
    values = torch.randn(2, 9, widths, 24, generator=g)
    z = torch.randn(2, 9, widths, generator=g)
    y = z.softmax(-1) if soft else torch.nn.functional.one_hot(z.argmax(-1), widths).float()
    grad = torch.randn(9, 2, 3, 8, generator=g).transpose(0, 1)  # strided, as the layer's gradient arrives
    return values, y, grad


def test_the_write_sum_kernels_give_the_matmuls_values():
    """`relaxed_write`: on straight-through one-hots the chosen width's values bit for bit (soft
    weights within rounding: the matmul adds the widths in another order), in x's shape;
    `relaxed_write_backward`: each width's values dotted with a strided gradient, within float32
    rounding of the exact sums."""
    from triroute_kernels import cpu_ops_available

    assert cpu_ops_available(), "the C++ kernels did not build here"
    for soft in (False, True):
        values, y, grad = _written_case(soft)
        out = torch.ops.triroute.relaxed_write(values, y, [2, 9, 3, 8])
        want = (y.unsqueeze(-2) @ values).view(2, 9, 3, 8)
        assert out.shape == (2, 9, 3, 8) and out.is_contiguous()
        if soft:
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(out, want)
        exact = (values.double() @ grad.double().reshape(2, 9, -1, 1)).squeeze(-1)
        torch.testing.assert_close(torch.ops.triroute.relaxed_write_backward(values, grad).double(), exact,
                                   rtol=1e-6, atol=1e-6)


def test_the_write_is_one_kernel_call_each_way_with_the_definitions_gradients():
    """Under autograd the write's sum dispatches one forward and one backward kernel call (with the
    quantisation's one call before it), and gives the gradients of the matmuls it stands for: the
    identity to x, each width's values to the bit head."""
    from tests.dispatched import DispatchedOps

    _, y, grad = _written_case(False)
    x = torch.randn(2, 9, 3, 8).requires_grad_()
    y = y.requires_grad_()
    with DispatchedOps() as ops:
        out = relaxed_kv_write(x, y, (2, 4, 8, 16), 4)
        d_x, d_y = torch.autograd.grad(out, (x, y), grad)
    assert ops.names == ["quantized_values", "relaxed_write", "relaxed_write_backward"], ops.names
    assert torch.equal(d_x, grad)
    values = torch.stack([fake_quantize(x.detach(), b, 4).reshape(2, 9, -1) for b in (2, 4, 8, 16)], 2)
    torch.testing.assert_close(d_y, (values @ grad.reshape(2, 9, -1, 1)).squeeze(-1), rtol=1e-6, atol=1e-6)
    assert torch.equal(out, (y.detach().unsqueeze(-2) @ values).view_as(out))
