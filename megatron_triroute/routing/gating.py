"""Expert gating with a null expert (Sec. axes (B))."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from triroute_kernels import HAS_TRITON, takes_cpu_kernel

from .kernel_check import checked_once, first_use_probe
from .softmax import softmax

NULL_EXPERT = -1
"""`expert_index` value of the null expert f_0 = 0 (never dispatched, costs nothing): option 0 - 1,
so `top_k_gating` maps options to experts by one subtraction."""


@dataclass
class ExpertRoutes:
    probs: torch.Tensor
    """(..., E') softmax over the options; with a null expert, option 0 is null."""
    index: torch.Tensor
    """(..., k) selected real expert ids in [0, E), or NULL_EXPERT."""
    weight: torch.Tensor
    """(..., k) renormalised gates p_j / sum_{j' in S} p_j' of the selected options."""
    option: torch.Tensor
    """(..., k) selected option ids in [0, E') (option 0 = null when enabled)."""


def option_probs(logits: torch.Tensor) -> torch.Tensor:
    """p = softmax(z^e) over the E' expert options, in float32: what the gates renormalise."""
    return softmax(logits.float())


def top_k_gating(logits: torch.Tensor, top_k: int, null_expert: bool) -> ExpertRoutes:
    """FFN_t = sum_{j in S_t} (p_j / sum_{j' in S_t} p_j') f_j  (Sec. axes, Eq. for FFN_t).

    p = softmax(z^e) over E' = E (+1 null) options; S_t = TopK(p, k); gates renormalised over
    S_t, so gradients reach W_e through the selected gates (Switch/GShard). Null semantics:
    with k = 1 a token whose top option is null gets gate 1 on f_0 = 0, i.e. exactly zero FFN
    output; with k = 2 and S = {null, j} exactly one expert runs and the token gets
    p_bar_j * f_j with p_bar_j = p_j / (p_0 + p_j). Ties break toward the lower option id
    (torch.topk's order is not specified for ties; we sort first to pin it).
    """
    probs = option_probs(logits)
    option, weight = top_k_gates(probs, top_k)
    if null_expert:
        index = option - 1  # option 0, the null expert, becomes NULL_EXPERT (-1); option j >= 1, expert j - 1
    else:
        index = option
    return ExpertRoutes(probs=probs, index=index, weight=weight.to(logits.dtype), option=option)


def top_k_gates(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(option, weight): the top_k options S of each row of probs and their renormalised gates
    p_S / max(sum p_S, 1e-20), with the gates' gradient to probs. The tensor ops are the definition
    (a stable descending sort, so ties break toward the lower option id on every rank alike, then
    `renormalised_gates`); where a kernel takes the rows (`gate_kernels`) both ways are one call
    each, the same values."""
    kernels = gate_kernels(probs)
    if kernels is not None:
        if probs.requires_grad and torch.is_grad_enabled():
            weight, option = _KernelGates.apply(probs, top_k, kernels)
            return option, weight
        option, weight, _ = kernels[0](probs, top_k)
        return option, weight
    option = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :top_k]
    return option, renormalised_gates(probs, option)


GateKernels = tuple[Callable[..., tuple[torch.Tensor, ...]], Callable[..., torch.Tensor]]


def gate_kernels(probs: torch.Tensor) -> GateKernels | None:
    """(forward, backward) kernels of `top_k_gates` for these rows: the C++ kernels
    `torch.ops.triroute.top_k_gates` / `top_k_gates_backward` (float32 CPU rows of up to 16 options,
    the definition's bits), the Triton kernels of `triroute_kernels.triton_gumbel` on a GPU (once
    their first use has given the definition's values); None where the tensor ops serve (and under
    torch.compile)."""
    if probs.shape[-1] > GATE_KERNEL_OPTIONS:
        return None
    if takes_cpu_kernel(probs):
        return torch.ops.triroute.top_k_gates, torch.ops.triroute.top_k_gates_backward
    if probs.is_cuda and HAS_TRITON and probs.dtype == torch.float32 and not torch.compiler.is_compiling():
        return checked_once(("expert gates", str(probs.device)), lambda: _checked_triton(probs.device))
    return None


GATE_KERNEL_OPTIONS = 16
"""Options (experts, with the null one) a row may have for the gate kernels."""


def _checked_triton(device: torch.device) -> GateKernels | None:
    """The Triton gate kernels once they have given the definition's options and gates exactly and
    its gradient within float32 rounding, on a probe with tied probabilities; else None with a
    warning, and the tensor ops serve."""
    def load() -> GateKernels:
        from triroute_kernels.triton_gumbel import top_k_gates_backward_triton, top_k_gates_triton

        return top_k_gates_triton, top_k_gates_backward_triton

    def agrees(kernels: GateKernels) -> bool:
        gen = torch.Generator().manual_seed(0)
        for n, k in ((5, 2), (9, 1), (4, 3)):
            probs = torch.randn(200, n, generator=gen).softmax(-1)
            probs[0] = 1.0 / n  # every option tied: the lowest k
            probs = probs.to(device)
            grad = torch.randn(200, k, generator=gen).to(device)
            option, weight, total = kernels[0](probs, k)
            want_option = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :k]
            want_weight, want_total = _gates(probs, want_option)
            want_d = torch.zeros_like(probs).scatter_(
                -1, want_option, (grad - (grad * want_weight).sum(-1, keepdim=True)) / want_total)
            if not (torch.equal(option, want_option) and torch.equal(weight, want_weight)
                    and torch.allclose(kernels[1](grad, option, probs, total), want_d, rtol=1e-5, atol=1e-6)):
                return False
        return True

    return first_use_probe(device, "the expert gates", load, agrees)


class _KernelGates(torch.autograd.Function):
    """`top_k_gates` through its kernels: (weight, option), the option not differentiable; the
    gradient to probs `_RenormalisedGates`' expression, one call."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, top_k: int, kernels: GateKernels):
        option, weight, total = kernels[0](probs, top_k)
        # the gates are recomputed from probs backward: saving an output costs a detach each way
        ctx.save_for_backward(option, probs, total)
        ctx.backward_kernel = kernels[1]
        ctx.mark_non_differentiable(option)
        ctx.set_materialize_grads(False)  # the option's gradient: none, and no zeros made for it
        return weight, option

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, _):
        if grad is None:  # the gates reached nothing that takes a gradient
            return None, None, None
        option, probs, total = ctx.saved_tensors
        return ctx.backward_kernel(grad.contiguous(), option, probs, total), None, None


def renormalised_gates(probs: torch.Tensor, option: torch.Tensor) -> torch.Tensor:
    """weight = p_S / max(sum p_S, 1e-20), p_S = probs.gather(-1, option) (`top_k_gating`'s gates),
    with its gradient to `probs` from one autograd node (`_RenormalisedGates`) where one is needed."""
    if probs.requires_grad and torch.is_grad_enabled():
        return _RenormalisedGates.apply(probs, option)
    return _gates(probs, option)[0]


def _gates(probs: torch.Tensor, option: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, the clamped sum it divides by): the gates' definition."""
    chosen = probs.gather(-1, option)
    total = chosen.sum(-1, keepdim=True).clamp_min(1e-20)
    return chosen / total, total


class _RenormalisedGates(torch.autograd.Function):
    """`_gates`' weight, and its gradient to probs written out as one expression per row,

        dp_S = (dw - (dw . w)) / sum p_S,   dp = 0 off S,

    (the chain autograd would run through the division, the clamp, the sum and the gather, about
    thirteen ops where this takes six). The clamp's mask is left out: `option` holds the row's
    largest probability of a softmax over E' options, so sum p_S >= 1 / E' and the clamp never acts
    (it guards the forward only). The options of a row are distinct (a sort's first k), so the
    scatter writes each once."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, option: torch.Tensor) -> torch.Tensor:
        weight, total = _gates(probs, option)
        ctx.save_for_backward(option, weight, total)
        ctx.shape = probs.shape
        return weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        option, weight, total = ctx.saved_tensors
        d_chosen = (grad - (grad * weight).sum(-1, keepdim=True)) / total
        return grad.new_zeros(ctx.shape).scatter_(-1, option, d_chosen), None
