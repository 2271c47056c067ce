"""Host values on the compute device without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable host memory and then synchronises the
stream: the host waits until the device has run everything queued before it, once per call. Inside
a layer that is a wait per layer and step, and the device idles while the host catches up. Two
ways around it, one per kind of value:
- a constant (the bit widths' costs, the quantisation levels, a mode's one-hot row) is made once
  per device and kept: `device_constant`. The tensor is shared: never modify it in place.
- a value that changes from call to call (the noise hash's prefix of step and layer) is staged in
  pinned memory and copied with `non_blocking=True`, which queues the copy and returns:
  `to_device`. PyTorch keeps the pinned block until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_CONSTANTS: dict[tuple, torch.Tensor] = {}


def device_constant(values: Sequence[float | int], dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, made once per (values, dtype, device).
    Under torch.compile the graph makes it (a constant of the compiled code): the kept tensors are
    not read there, so filling the cache never invalidates a compiled graph."""
    device = torch.device(device if device is not None else "cpu")
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    key = (tuple(values), dtype, device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = to_device(values, dtype, device)
    return _CONSTANTS[key]


def to_device(values: Sequence[float | int], dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without a stream synchronise on CUDA."""
    device = torch.device(device if device is not None else "cpu")
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
