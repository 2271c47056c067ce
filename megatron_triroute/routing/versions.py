"""What a value kept between calls is keyed on: the tensors it was made from, unchanged since.

Values that change only when the tensors they are read from change (folded heads, the budget's
multipliers, whitening's divisor, the inference model's stacked experts and host tables) are made once
and kept under `version_key(their tensors)`, made again when the key differs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def version_key(tensors: Iterable[torch.Tensor]) -> tuple:
    """A key equal between two calls while none of `tensors` has been replaced or written in place:
    each one's storage address and version counter. A tensor made under inference mode keeps no
    version counter; then the key equals no other, and what is kept under it is made again at each
    call. The key holds no tensor: a caller that must rule out a freed tensor's address reused by a
    new one keeps the tensors themselves beside it."""
    tensors = tuple(tensors)
    if any(t.is_inference() for t in tensors):
        return (object(),)
    return tuple((t.data_ptr(), t._version) for t in tensors)
