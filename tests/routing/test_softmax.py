"""The routing axes' softmax and its gradient equal PyTorch's, and a CPU row of few options takes
the written-out forward, not PyTorch's softmax kernel."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_triroute.routing.softmax import FEW, MANY, _softmax_ops, softmax
from triroute_kernels import cpu_ops_available


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(7, 1), (512, 1), (64, 3), (256, 3), (8, 16, 4, 3), (5, 2, 5), (33, FEW),
                                   (9, FEW + 1), (64, FEW + 1)])
def test_values_and_gradients_equal_pytorchs(shape, dtype):
    torch.manual_seed(0)
    z = (torch.randn(shape, dtype=dtype) * 30).requires_grad_()  # spread wide: the shift matters
    z_ref = z.detach().clone().requires_grad_()
    y, y_ref = softmax(z), F.softmax(z_ref, -1)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-14, rtol=1e-12)
    torch.testing.assert_close(y, y_ref, **tol)
    grad = torch.randn(shape, dtype=dtype)
    y.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(z.grad, z_ref.grad, **tol)


def test_large_logits_do_not_overflow_and_masked_options_get_zero():
    z = torch.tensor([[1000.0, 999.0, -float("inf")], [-1000.0, -1001.0, -1002.0]]).repeat(MANY, 1)
    y = softmax(z)
    torch.testing.assert_close(y, F.softmax(z, -1))
    assert (y[0::2, 2] == 0).all() and torch.isfinite(y).all()


def test_many_cpu_rows_of_few_options_take_the_written_out_ops():
    with _Ops() as few:
        softmax(torch.randn(64, 4, 3, requires_grad=True)).sum().backward()
    with _Ops() as wide:
        softmax(torch.randn(64, FEW + 1, requires_grad=True)).sum().backward()
    with _Ops() as small:  # a decode step's rows
        softmax(torch.randn(2, 9, requires_grad=True)).sum().backward()
    written_out = "triroute.few_softmax" if cpu_ops_available() else "aten.amax"
    assert "aten._softmax" not in few.names and written_out in few.names, few.names
    assert "aten._softmax" in wide.names and "aten._softmax" in small.names, (wide.names, small.names)
    assert all("aten._softmax_backward_data" in ops.names for ops in (few, wide, small))


@pytest.mark.skipif(not cpu_ops_available(), reason="the C++ kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_kernel_equals_the_written_out_ops(dtype):
    """`torch.ops.triroute.few_softmax` against its definition, the five tensor ops: every width
    from 1 to FEW, rows far from zero, masked (-inf) options, a non-contiguous input."""
    g = torch.Generator().manual_seed(3)
    tol = dict(atol=1e-7, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-15, rtol=1e-13)
    for n in range(1, FEW + 1):
        z = torch.randn(300, n, generator=g, dtype=dtype) * 40 + 500
        if n > 1:
            z[::3, n - 1] = -float("inf")
        for x in (z, z.t().contiguous().t(), z.view(30, 10, n)[:, ::2]):
            y = torch.ops.triroute.few_softmax(x)
            assert y.shape == x.shape and y.dtype == dtype
            torch.testing.assert_close(y, _softmax_ops(x.clone()), **tol)
            torch.testing.assert_close(y.sum(-1), torch.ones(x.shape[:-1], dtype=dtype), **tol)
    assert (torch.ops.triroute.few_softmax(z)[::3, FEW - 1] == 0).all()
    with pytest.raises(RuntimeError, match="1 to 16"):
        torch.ops.triroute.few_softmax(torch.zeros(2, FEW + 1, dtype=dtype))
