"""The one dispatch point: Triton on CUDA tensors (or when forced), the torch twins otherwise.

`TRIROUTE_KERNELS=torch|triton|auto` (default auto) or the `backend=` argument force a choice.
Forcing Triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is first imported.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .pool import PagePool
from .torch_ops import decode_attention_pool_torch, quantize_pack_into_torch

BACKENDS = ("auto", "torch", "triton")


def has_triton() -> bool:
    """Whether triton is installed (found without importing it: importing is slow and, for the
    interpreter, must come after TRITON_INTERPRET is set)."""
    return importlib.util.find_spec("triton") is not None


def choose_backend(device: torch.device, backend: str | None = None) -> str:
    """'triton' or 'torch' for tensors on `device`."""
    choice = backend or os.environ.get("TRIROUTE_KERNELS", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"kernel backend {choice!r} (argument or TRIROUTE_KERNELS) must be one of {BACKENDS}")
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not has_triton():
            raise RuntimeError("kernel backend 'triton' was forced but triton is not installed (pip install triton)")
        return "triton"
    return "triton" if device.type == "cuda" and has_triton() else "torch"


def quantize_pack_into(
    x: torch.Tensor, bits: int, group_size: int, pool: PagePool, slots: torch.Tensor, backend: str | None = None
) -> None:
    """Quantise x [N, H_kv, d_h] at `bits` into `pool` at flat `slots` (page * P + offset), in place."""
    if choose_backend(pool.device, backend) == "triton":
        from .triton_ops import quantize_pack_into_triton

        return quantize_pack_into_triton(x, bits, group_size, pool, slots)
    return quantize_pack_into_torch(x, bits, group_size, pool, slots)


def decode_attention_pool(
    q: torch.Tensor,
    k_pool: PagePool,
    v_pool: PagePool,
    bits: int,
    group_size: int,
    page_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    sm_scale: float,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H_q, d_h], lse [B, H_q]) of one query per request over one pool (see kernels_spec)."""
    if choose_backend(k_pool.device, backend) == "triton":
        from .triton_ops import decode_attention_pool_triton

        return decode_attention_pool_triton(q, k_pool, v_pool, bits, group_size, page_table, lo, hi, sm_scale)
    return decode_attention_pool_torch(q, k_pool, v_pool, bits, group_size, page_table, lo, hi, sm_scale)
