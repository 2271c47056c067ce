"""A GPU kernel taken only once it has given its definition's values: the first-use check of the
training path's Triton kernels (the noise's hash, the relaxed K/V write, the mode mix, the experts'
combine, the straight-through sample, the expert gates)."""

from __future__ import annotations

import warnings
from typing import Callable, Hashable, TypeVar

import torch

_CHECKED: dict[Hashable, Callable[..., torch.Tensor] | None] = {}


def checked_once(key: Hashable, check: Callable[[], Callable[..., torch.Tensor] | None]) -> Callable[..., torch.Tensor] | None:
    """`check()`'s answer (a kernel or None) for `key` (a kernel, device and layout), computed at
    the key's first use in this process and kept."""
    if key not in _CHECKED:
        _CHECKED[key] = check()
    return _CHECKED[key]


def first_use_check(device: torch.device, load: Callable[[], Callable[..., torch.Tensor]],
                    reference: Callable[..., torch.Tensor], probe: tuple, what: str) -> Callable[..., torch.Tensor] | None:
    """The kernel `load()` gives, once it has returned exactly `reference`'s values on the `probe`
    arguments (tensors on `device`); else None, with a warning naming why (other values, or a
    kernel that fails to build there): the caller's tensor chain serves instead, the values never
    change. Callers keep the answer per device and layout (`checked_once`), so this runs once for each."""
    return first_use_probe(device, what, load, lambda kernel: torch.equal(kernel(*probe), reference(*probe)))


K = TypeVar("K")


def first_use_probe(device: torch.device, what: str, load: Callable[[], K], agrees: Callable[[K], bool]) -> K | None:
    """The kernels `load()` gives (one, or a forward and a backward), once `agrees(kernels)` has run
    them on a probe and found the definition's values; else None, with a warning naming why (other
    values, or kernels that fail to build there), and the tensor ops serve."""
    try:
        kernels = load()
        if agrees(kernels):
            return kernels
        reason = "its values differ from the tensor chain's"
    except Exception as e:  # a Triton build that fails on this GPU
        reason = f"{type(e).__name__}: {e}"
    warnings.warn(f"the Triton kernel of {what} is not used on {device} ({reason}); the tensor chain computes "
                  "the same values. Fix: report it with your triton and GPU versions")
    return None
