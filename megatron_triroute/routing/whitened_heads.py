"""The controller's whitened heads (Eq. whiten) as one kernel call each way: the training path of
`trunk_grad.SharedTrunkLogits`.

u (N, D) holds every head's pre-bias projection end to end (head i: its `RunningWhitening`'s
features); each head's logits are

    s = (u - mean) / denom,   z = gain * s + bias   (denom = sqrt(var) + eps),

with the rows' count, column sums and column sums of squares added to each head's accumulator in a
training forward (`RunningWhitening.whiten_all`), and the gradient

    du = dz * (gain / denom),   d gain = sum_rows dz * s,   d bias = sum_rows dz.

mean and denom are the ones `RunningWhitening.standardisation` keeps for the step (made once after
each commit); the backward takes the forward's denom.

The tensor ops below (`heads_torch`, `heads_backward_torch`: `whiten_all`, the statistics'
concatenation, the gains' and biases', a product and a sum forward; two sums, two products, a
division and two splits backward) are the definition. Where a kernel takes the tensors the node runs
it instead, one call each way: the C++ kernels `torch.ops.triroute.whiten_heads` /
`whiten_heads_backward` on a CPU (float32, where built), the Triton kernels of
`triroute_kernels.triton_whiten` on a GPU (once their first use has given the definition's values).
z, s and du are the definition's bits; the statistics are summed in float64 in another order, and d gain
and d bias in float64 rounded once (the definition sums in float32): equal to rounding.
"""

from __future__ import annotations

from typing import Callable

import torch
from triroute_kernels import HAS_TRITON, takes_cpu_kernel

from .kernel_check import checked_once, first_use_probe
from .whitening import RunningWhitening

Kernels = tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]],
                Callable[..., tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]]


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def heads_torch(whiten: list[RunningWhitening], u: torch.Tensor, gain: list[torch.Tensor],
                bias: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, s) as tensor ops, accumulating as `whiten_all` does: the definition."""
    s = RunningWhitening.whiten_all(whiten, u)
    return _joined(gain) * s + _joined(bias), s


def heads_backward_torch(dz: torch.Tensor, s: torch.Tensor, denom: torch.Tensor, gain: list[torch.Tensor]
                         ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(du, [d gain_i], [d bias_i]) as tensor ops, `denom` the forward's sqrt(var) + eps (D,): the
    definition."""
    sizes = [g.shape[0] for g in gain]
    split = (lambda g: list(g.split(sizes))) if len(sizes) > 1 else (lambda g: [g])  # noqa: E731
    return dz * (_joined(gain) / denom), split((dz * s).sum(0)), split(dz.sum(0))


def heads_kernels(u: torch.Tensor, whiten: list[RunningWhitening], gain: list[torch.Tensor],
                  bias: list[torch.Tensor]) -> Kernels | None:
    """(forward, backward) kernels for these tensors, called as
    forward(u, mean, denom, gains, biases, accumulators) -> (z, s) and
    backward(dz, s, denom, gains) -> (du, d gains, d biases); None where the tensor ops serve (no
    kernel built or checked for the device or dtype; under torch.compile, which traces the tensor ops)."""
    f32 = all(t.dtype == torch.float32 for t in (*gain, *bias, *(m.mean for m in whiten), *(m.var for m in whiten)))
    if not f32 or u.dtype != torch.float32 or u.dim() != 2 or u.stride(-1) != 1:
        return None
    if takes_cpu_kernel(u):
        return torch.ops.triroute.whiten_heads, torch.ops.triroute.whiten_heads_backward
    if u.is_cuda and HAS_TRITON and not torch.compiler.is_compiling():
        from triroute_kernels import triton_whiten

        widths = tuple(g.shape[0] for g in gain)
        if triton_whiten.fits(widths):
            return checked_once(("whitened heads", str(u.device), widths), lambda: _checked_triton(u.device, widths))
    return None


def _checked_triton(device: torch.device, widths: tuple[int, ...]) -> Kernels | None:
    """The Triton kernels once they have given the definition's values on a probe of these heads'
    widths: z, s and du exactly, the accumulators and d gain, d bias within rounding of the
    definition's. Else None with a warning, and the tensor ops serve."""
    def load() -> Kernels:
        from triroute_kernels.triton_whiten import whiten_heads_backward_triton, whiten_heads_triton

        return whiten_heads_triton, whiten_heads_backward_triton

    def agrees(kernels: Kernels) -> bool:
        gen = torch.Generator().manual_seed(0)
        heads = [RunningWhitening(d).to(device) for d in widths]
        for m in heads:
            m.mean.copy_(torch.randn(m.mean.shape, generator=gen))
            m.var.copy_(torch.rand(m.var.shape, generator=gen) + 0.5)
        gain = [(torch.rand(d, generator=gen) + 0.5).to(device) for d in widths]
        bias = [torch.randn(d, generator=gen).to(device) for d in widths]
        u = torch.randn(70, sum(widths), generator=gen).to(device)
        dz = torch.randn(70, sum(widths), generator=gen).to(device)
        mean, denom = RunningWhitening.standardisation(heads)
        z, s = kernels[0](u, mean, denom, gain, bias, [m._acc for m in heads])
        got_acc = [m._acc.clone() for m in heads]
        for m in heads:
            m._acc.zero_()
        want_z, want_s = heads_torch(heads, u, gain, bias)
        du, d_gain, d_bias = kernels[1](dz, s, denom, gain)
        want = heads_backward_torch(dz, want_s, denom, gain)
        close = lambda a, b: all(torch.allclose(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(a, b))  # noqa: E731
        return (torch.equal(z, want_z) and torch.equal(s, want_s) and torch.equal(du, want[0])
                and all(torch.allclose(a, m._acc, rtol=1e-12, atol=1e-9) for a, m in zip(got_acc, heads))
                and close(d_gain, want[1]) and close(d_bias, want[2]))

    return first_use_probe(device, "the controller's whitened heads", load, agrees)


def whitened_heads(whiten: list[RunningWhitening], u: torch.Tensor, gain: list[torch.Tensor],
                   bias: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable | None]:
    """(z, s, denom, the backward kernel or None) of u under `whiten`'s heads, accumulating their
    statistics in a training forward (`RunningWhitening.should_accumulate`); one kernel call where
    `heads_kernels` has one. The modules must share eps (`RunningWhitening.standardisation` checks)."""
    kernels = heads_kernels(u, whiten, gain, bias)
    if kernels is None:
        z, s = heads_torch(whiten, u, gain, bias)
        return z, s, RunningWhitening.standardisation(whiten)[1], None
    mean, denom = RunningWhitening.standardisation(whiten)
    acc = [m._acc for m in whiten] if whiten[0].should_accumulate() else []
    z, s = kernels[0](u, mean, denom, gain, bias, acc)
    return z, s, denom, kernels[1]
