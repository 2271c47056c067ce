"""Capture and restore every global random generator as a checkpointable tree (tensors and ints).

Python's `random` state is a tuple of 625 ints below 2**32 plus a cached Gaussian; numpy's legacy
global state is 624 uint32 words plus a position and a cached Gaussian; torch's are byte tensors.
All become int64/uint8 tensors and JSON numbers, so the tree saves through safetensors + JSON
without pickling. CUDA states are captured only when CUDA is available.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    version, words, gauss_next = random.getstate()
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {
            "algorithm": algorithm,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(int(w) for w in python["state"].tolist()), python["gauss_next"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["algorithm"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch_cpu"].to(dtype=torch.uint8, device="cpu"))
    cuda_states = state.get("torch_cuda")
    if cuda_states:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.to(dtype=torch.uint8, device="cpu") for s in cuda_states])
        else:
            log.warning("checkpoint holds CUDA RNG states but CUDA is unavailable: not restored")
