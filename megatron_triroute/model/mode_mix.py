"""The relaxed attention's mix of its reading modes, out = sum_m y[m] * Attn^(m) (Alg. 1, line 4), as
one autograd node: the training path of `attention.routed_attention`.

    out[b, t, h, :] = sum over READING_MODES m of modes[b, t, h, m] * attn_m[b, t, h, :]
    d attn_m = grad * modes[..., m, None],   d modes[..., m] = sum_d grad * attn_m   (0 for SKIP)

The tensor ops below (`mix_torch`, `mix_backward_torch`: a product and a multiply-add per mode
forward; a product and a product-and-sum per mode, a zero column, a stack and a cast backward) are
the definition. Where a kernel takes the tensors the node runs it instead, one call each way, one
pass over the activations: the C++ kernels `torch.ops.triroute.mode_mix` / `mode_mix_backward` on a
CPU (float32, where built), the Triton kernels of `triroute_kernels.triton_mix` on a GPU (once their
first use has given the definition's values). The forward's values are the definition's bit for
bit (products rounded as `mul` and `addcmul` round them; on straight-through one-hots every product
is exact), and so are d attn; d modes sums each row in another order (equal to rounding). The
kernels lay the output out token-major ([t, b, h, :] contiguous), the layout the output projection
reads [T, B, H d] in, so that read copies nothing.
"""

from __future__ import annotations

from typing import Callable

import torch
from triroute_kernels import HAS_TRITON, takes_cpu_kernel

from ..routing.kernel_check import checked_once, first_use_probe
from ..routing.modes import N_MODES, READING_MODES


def mix_torch(modes: torch.Tensor, attn: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The forward as tensor ops, in attn's dtype: the definition."""
    w = modes.to(attn[0].dtype)
    out = attn[0] * w[..., READING_MODES[0]:READING_MODES[0] + 1]
    for a, m in zip(attn[1:], READING_MODES[1:]):
        out.addcmul_(a, w[..., m:m + 1])
    return out


def mix_backward_torch(grad: torch.Tensor, modes: torch.Tensor,
                       attn: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(d modes in modes' dtype, [d attn_m]) as tensor ops: the definition (autograd's own gradient
    of `mix_torch`, its products and sums, written into one (B, T, H, N_MODES) tensor)."""
    w = modes.to(attn[0].dtype)
    d_attn = [grad * w[..., m:m + 1] for m in READING_MODES]
    dots = dict(zip(READING_MODES, ((grad * a).sum(-1) for a in attn)))
    zero = torch.zeros_like(dots[READING_MODES[0]])
    return torch.stack([dots.get(m, zero) for m in range(N_MODES)], -1).to(modes.dtype), d_attn


Kernels = tuple[Callable[..., torch.Tensor], Callable[..., tuple[torch.Tensor, list[torch.Tensor]]]]


def mix_kernels(modes: torch.Tensor, attn: tuple[torch.Tensor, ...]) -> Kernels | None:
    """(forward, backward) kernels for these tensors, each called as (…, modes, attn, columns); None
    where the tensor ops serve (no kernel built or checked for the device, dtype or layout; under
    torch.compile, which traces the tensor ops)."""
    if takes_cpu_kernel(attn[0]) and modes.dtype == torch.float32 and all(a.stride(-1) == 1 for a in attn):
        return torch.ops.triroute.mode_mix, torch.ops.triroute.mode_mix_backward
    if attn[0].is_cuda and HAS_TRITON and not torch.compiler.is_compiling():
        from triroute_kernels import triton_mix

        if triton_mix.fits(modes, attn):
            key = ("mode mix", str(attn[0].device), attn[0].dtype, modes.dtype, attn[0].shape[-1], len(attn))
            return checked_once(key, lambda: _checked_triton(attn[0].device, attn[0].dtype, modes.dtype,
                                                             attn[0].shape[-1]))
    return None


def _checked_triton(device: torch.device, dtype: torch.dtype, modes_dtype: torch.dtype, d: int) -> Kernels | None:
    """The Triton kernels once they have given the definition's values on a probe of this layout:
    straight-through one-hots (what training mixes with), one output transposed as the full
    attention's is; the forward and d attn exactly, d modes within float32 rounding of the exact sums
    (the definition rounds each product to the tensors' dtype before summing, the kernel does not).
    Else None with a warning, and the tensor ops serve."""
    def load() -> Kernels:
        from triroute_kernels.triton_mix import mode_mix_backward_triton, mode_mix_triton

        return mode_mix_triton, mode_mix_backward_triton

    def agrees(kernels: Kernels) -> bool:
        gen = torch.Generator().manual_seed(0)
        choice = torch.randint(0, N_MODES, (2, 5, 3), generator=gen)
        modes = torch.nn.functional.one_hot(choice, N_MODES).to(device, modes_dtype)
        attn = (torch.randn(2, 5, 3, d, generator=gen).to(device, dtype),
                torch.randn(2, 3, 5, d, generator=gen).to(device, dtype).transpose(1, 2))
        grad = torch.randn(2, 5, 3, d, generator=gen).to(device, dtype)
        columns = list(READING_MODES)
        d_modes, d_attn = kernels[1](grad, modes, attn, columns)
        exact = torch.stack([(grad.double() * attn[columns.index(m)].double()).sum(-1) if m in columns
                             else torch.zeros(grad.shape[:3], dtype=torch.float64, device=device)
                             for m in range(N_MODES)], -1)
        return (torch.equal(kernels[0](modes, attn, columns), mix_torch(modes, attn))
                and all(torch.equal(a, b) for a, b in zip(d_attn, mix_backward_torch(grad, modes, attn)[1]))
                and torch.allclose(d_modes.double(), exact, rtol=1e-5, atol=1e-5))

    return first_use_probe(device, "the attention's mode mix", load, agrees)


class ModeMix(torch.autograd.Function):
    """`mix_torch` of modes (B, T, H, N_MODES) and one attention output per `READING_MODES` mode
    (B, T, H, d), with `mix_backward_torch` as its gradient, each one kernel call where
    `mix_kernels` has kernels for the tensors (module doc)."""

    @staticmethod
    def forward(ctx, modes: torch.Tensor, *attn: torch.Tensor) -> torch.Tensor:
        kernels = mix_kernels(modes, attn)
        ctx.save_for_backward(modes, *attn)
        ctx.backward_kernel = kernels[1] if kernels is not None else None
        return mix_torch(modes, attn) if kernels is None else kernels[0](modes, attn, list(READING_MODES))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        modes, *attn = ctx.saved_tensors
        kernel = ctx.backward_kernel
        if kernel is not None and grad.stride(-1) == 1 and grad.dtype == attn[0].dtype:
            d_modes, d_attn = kernel(grad, modes, attn, list(READING_MODES))
            d_modes = d_modes.to(modes.dtype)
        else:
            d_modes, d_attn = mix_backward_torch(grad, modes, tuple(attn))
        return (d_modes if ctx.needs_input_grad[0] else None,
                *(d if ctx.needs_input_grad[1 + i] else None for i, d in enumerate(d_attn)))
