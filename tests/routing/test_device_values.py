"""routing/device_values.py: constants made once per device, host values copied without a wait."""

import pytest
import torch

from megatron_triroute.routing.device_values import device_constant, to_device


def test_device_constant_is_made_once_per_values_dtype_and_device():
    a = device_constant([1.0, 3.0], torch.float64, "cpu")
    assert torch.equal(a, torch.tensor([1.0, 3.0], dtype=torch.float64))
    assert device_constant((1.0, 3.0), torch.float64, None) is a  # the same values: the kept tensor
    assert device_constant([1.0, 3.0], torch.float32, "cpu") is not a
    assert device_constant([1.0, 4.0], torch.float64, "cpu") is not a


def test_to_device_equals_torch_tensor():
    values = [5, -1, 2**40]
    out = to_device(values, torch.int64, "cpu")
    assert torch.equal(out, torch.tensor(values, dtype=torch.int64))
    assert to_device(values, torch.int64, "cpu") is not out  # a fresh tensor every call


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_neither_synchronises_the_stream():
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        out = to_device([1, 2, 3], torch.int64, "cuda")
        const = device_constant([0.5], torch.float32, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.tolist() == [1, 2, 3] and const.item() == 0.5
