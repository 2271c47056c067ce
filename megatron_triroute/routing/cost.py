"""Multi-resource cost model (Sec. cost, Eq. cost; Appendix A normalisation).

Units: FLOPs are counted as multiply-accumulates (MACs), as the paper's kappa do
(kappa_full = 2 d t: d_h MACs for q.k plus d_h for the weighted value sum, per head and key;
kappa_e = 3 d d_e: the three SwiGLU matrices). Memory is counted in bits of K/V cache.

Pinned choices (ours):
- Keys read (0-based position t): skip 0, local min(t, w) + 1 (keys max(0, t-w)..t, the
  paper's K_[t-w, t] inclusive), full t + 1. Both the surrogate and the hard accounting use
  these counts; the dense reference uses full.
- Projections are not in the budget (Appendix A's dense cost has none); the hard accounting
  reports them separately so the inference engine can compare measured with accounted cost.
- Experts: the paper weights kappa_e by the renormalised gates p_bar, whose sum over the
  selected set is always 1, so with top-2 it neither counts two experts nor gives any
  gradient towards choosing the null expert. We use a straight-through *swap margin*
  (`expert_count_surrogate`): the forward value is the exact number of real experts that run,
  and the gradient acts only where a change of selection would change that number — see there.
- Memory includes quantisation metadata (float16 scale + zero per group) on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from triroute_kernels import HAS_TRITON, takes_cpu_kernel

from ..config import ModelConfig, RouterConfig
from .controller import RouterOutput
from .device_values import device_constant
from .kernel_check import checked_once, first_use_probe
from .modes import N_MODES, keys_read
from .quant import kv_bits_per_token


def expert_width(model: ModelConfig, router: RouterConfig) -> int:
    """Width of one SwiGLU expert (see ModelConfig.expert_d_ff)."""
    if model.expert_d_ff:
        return model.expert_d_ff
    width = -(-model.d_ff // router.top_k)  # ceil
    return -(-width // 8) * 8


def bit_costs(router: RouterConfig, model: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """(|bits|,) bits per token and layer for each bit option, metadata included, on `device` (a
    kept constant, `device_values.device_constant`: never modify it in place)."""
    g = router.group_size_for(model)
    widths = router.bits if router.bit_routing else (router.uniform_bits,)
    return device_constant([kv_bits_per_token(b, model.d_kv, g) for b in widths], torch.float64, device)


@dataclass
class LayerCost:
    flops: torch.Tensor
    """(B, T) MACs of attention reads + experts for this layer."""
    mem: torch.Tensor
    """(B, T) bits written to this layer's KV cache."""


@dataclass(frozen=True)
class MicroBatchCosts:
    """What the cost model reads that is the same at every layer of a micro-batch: computed once
    (`micro_batch_costs`; `state.RoutingInputs.costs` keeps it), passed to `expected_cost`,
    `hard_cost` and `budget_fractions` in place of recomputing it per layer."""

    keys: torch.Tensor
    """(B or 1, T, N_MODES) float64: keys a query reads in each mode (`modes.keys_read`)."""
    dense_sums: torch.Tensor
    """(2,) float64: the dense [flops, mem] summed over the micro-batch's B x T tokens (sums of
    integers below 2^53: exact)."""


def micro_batch_costs(positions: torch.Tensor, batch: int, model: ModelConfig, router: RouterConfig) -> MicroBatchCosts:
    """`MicroBatchCosts` of `batch` sequences at `positions` (T,) or (B, T)."""
    return MicroBatchCosts(_keys(positions, router), _dense_sums(positions, batch, model))


def _keys(positions: torch.Tensor, router: RouterConfig) -> torch.Tensor:
    """`MicroBatchCosts.keys` of `positions` (T,) or (B, T)."""
    return keys_read(positions, router.window).view(-1, positions.shape[-1], N_MODES)


def _dense_sums(positions: torch.Tensor, batch: int, model: ModelConfig) -> torch.Tensor:
    """`MicroBatchCosts.dense_sums` of `batch` sequences at `positions` (T,) (every sequence alike)
    or (B, T)."""
    dense = dense_cost(positions, model)
    return torch.stack([dense.flops.sum(), dense.mem.sum()]) * (batch if positions.dim() == 1 else 1)


def dense_cost(positions: torch.Tensor, model: ModelConfig) -> LayerCost:
    """Dense reference per token and layer (Appendix A): 2 d (t+1) + 3 d d_f MACs; 2 d_kv 16 bits."""
    t = positions.to(torch.float64)
    flops = 2.0 * model.d_model * (t + 1.0) + 3.0 * model.d_model * model.d_ff
    mem = torch.full_like(t, 2.0 * model.d_kv * 16)
    return LayerCost(flops, mem)


def expected_cost(out: RouterOutput, positions: torch.Tensor, model: ModelConfig, router: RouterConfig,
                  batch: MicroBatchCosts | None = None) -> LayerCost:
    """Differentiable per-token cost of one layer under the relaxed policy (Eq. cost).

    c_flops = sum_heads sum_m y_cost[m] * 2 d_h keys_m(t)  +  kappa_e * expert_count_surrogate(z^e, S)
    c_mem   = sum_b y_cost[b] * bits_per_token(b)
    positions: (T,) or (B, T) 0-based positions in the sequence; `batch`: their `micro_batch_costs`.
    """
    experts = None if out.experts is None else (out.expert_logits, out.experts.index)
    return _expected_cost(out.attn.y_cost, out.bits.y_cost, experts, positions, model, router, batch)


def layers_expected_cost(outs: list[RouterOutput], positions: torch.Tensor, model: ModelConfig,
                         router: RouterConfig, batch: MicroBatchCosts | None = None) -> LayerCost:
    """`expected_cost` of S layers in one pass: their decisions stacked, (S, B, T) flops and mem
    (one layer: `expected_cost`'s own (B, T))."""
    if len(outs) == 1:
        return expected_cost(outs[0], positions, model, router, batch)
    experts = None if outs[0].experts is None else (torch.stack([o.expert_logits for o in outs]),
                                                     torch.stack([o.experts.index for o in outs]))
    return _expected_cost(torch.stack([o.attn.y_cost for o in outs]), torch.stack([o.bits.y_cost for o in outs]),
                          experts, positions, model, router, batch)


def _expected_cost(attn_y_cost: torch.Tensor, bits_y_cost: torch.Tensor,
                   experts: tuple[torch.Tensor, torch.Tensor] | None, positions: torch.Tensor, model: ModelConfig,
                   router: RouterConfig, batch: MicroBatchCosts | None) -> LayerCost:
    """Eq. cost from the decisions' tensors, with any leading dims before (B, T): attn_y_cost
    (..., B, T, H, N_MODES), bits_y_cost (..., B, T, |bits|), experts (logits (..., B, T, E'),
    index (..., B, T, k)) or None for a dense FFN."""
    keys = _keys(positions, router) if batch is None else batch.keys
    kappa = 2.0 * model.d_head * keys  # (B or 1, T, N_MODES)
    attn = (attn_y_cost.double() * kappa.unsqueeze(2)).sum(dim=(-1, -2))
    flops = attn + _expert_flops(experts, attn.shape, attn.device, model, router)
    mem = (bits_y_cost.double() * bit_costs(router, model, bits_y_cost.device)).sum(-1)
    return LayerCost(flops, mem)


def expert_count_surrogate(expert_logits: torch.Tensor, index: torch.Tensor, null_expert: bool) -> torch.Tensor:
    """Straight-through count of the real experts a token runs (the expert part of Eq. cost).

    Forward: n_t = |{j in S_t : j real}|, the exact count. Gradient: only through the one swap
    that can lower n_t. With one null expert (option 0) the count falls only when the null
    enters S_t in place of the weakest selected real expert w = argmin_{j in S_t, real} p_j, so

        n_t + [null not in S_t] * (q_t - sg(q_t)),   q_t = p_w / (p_w + p_null) = sigmoid(z_w - z_null),

    whose gradient is kappa_e q(1 - q) on z_w and its negative on z_null, and zero on every
    other logit. A token whose top-k already holds the null expert runs the fewest real experts
    it can (k - 1 with top-k, one null), so it gets no pressure at all: the previous
    straight-through count (1 + p_j - sg p_j per selected real expert) kept lowering p_j there,
    which changes nothing executed and only shrinks the renormalised gate p_j / (p_null + p_j),
    turning the real expert's output down (a gate-weight collapse). Without a null expert no
    selection changes the count and the surrogate has no gradient.

    expert_logits: (..., E') raw router logits (option 0 = null when `null_expert`);
    index: (..., k) selected real expert ids or NULL_EXPERT (-1). Returns (...,) float64.
    """
    if not null_expert or not expert_logits.requires_grad:
        return (index >= 0).sum(-1).to(torch.float64)
    return _NullSwapMargin.apply(expert_logits, index)


def null_swap_margin_torch(expert_logits: torch.Tensor, index: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(runs, slope, weakest) of `_NullSwapMargin` as tensor ops, the definition: runs (...,) the real
    experts selected, float64; slope (...,) q (1 - q), 0 where the selection holds the null; weakest
    (..., 1) the weakest selected real expert's option id (the first of equal logits)."""
    z = expert_logits.double()
    option = index + 1  # option ids of the selected set: expert e is option e + 1, the null (-1) option 0
    null = index < 0
    z_weakest, slot = z.gather(-1, option).masked_fill(null, float("inf")).min(-1)  # logit order = p order
    has_null = null.any(-1)
    q = torch.sigmoid(torch.where(has_null, 0.0, z_weakest) - z[..., 0])
    runs = (~null).sum(-1).to(torch.float64)
    return runs, torch.where(has_null, 0.0, q * (1.0 - q)), option.gather(-1, slot.unsqueeze(-1))


def null_swap_margin_backward_torch(grad: torch.Tensor, slope: torch.Tensor, weakest: torch.Tensor, options: int,
                                    dtype: torch.dtype) -> torch.Tensor:
    """The logits' gradient (..., options) in `dtype` as tensor ops, the definition: g = grad * slope
    at the weakest, -g at the null."""
    g = grad * slope  # 0 where the top-k holds the null
    dz = g.new_zeros(*slope.shape, options).scatter_(-1, weakest, g.unsqueeze(-1))
    dz.select(-1, 0).sub_(g)  # the weakest is a real expert (option >= 1) wherever g != 0
    return dz.to(dtype)


def _swap_kernels(expert_logits: torch.Tensor, index: torch.Tensor) -> tuple[Callable, Callable] | None:
    """(forward, backward) kernels of `_NullSwapMargin` for these tensors, called as the `*_torch`
    functions are: `torch.ops.triroute.null_swap_margin` / `_backward` on a CPU (where built), the
    Triton kernels of `triroute_kernels.triton_routes` on a GPU (once their first use has given the
    definition's values); None where the tensor ops serve."""
    if expert_logits.dtype not in (torch.float32, torch.float64) or index.dtype != torch.int64 \
            or torch.compiler.is_compiling():
        return None
    if takes_cpu_kernel(expert_logits, (torch.float32, torch.float64)):
        return torch.ops.triroute.null_swap_margin, torch.ops.triroute.null_swap_margin_backward
    if expert_logits.is_cuda and HAS_TRITON:
        from triroute_kernels import triton_routes

        if triton_routes.swap_fits(expert_logits, index):
            return checked_once(("null swap margin", str(expert_logits.device)),
                                lambda: _checked_triton(expert_logits.device))
    return None


def _checked_triton(device: torch.device) -> tuple[Callable, Callable] | None:
    """The Triton kernels once they have given the definition's values on a probe (tokens with and
    without the null selected, only nulls, tied logits): runs, weakest and the gradient's zeros
    exactly, slope and the gradient within float64 rounding (the exponential is Triton's)."""
    def load() -> tuple[Callable, Callable]:
        from triroute_kernels.triton_routes import null_swap_margin_backward_triton, null_swap_margin_triton

        return null_swap_margin_triton, null_swap_margin_backward_triton

    def agrees(kernels: tuple[Callable, Callable]) -> bool:
        gen = torch.Generator().manual_seed(0)
        z = torch.randn(70, 5, generator=gen, dtype=torch.float64)
        z[3, 2] = z[3, 4]  # a tie between two selected experts
        index = torch.randint(-1, 4, (70, 2), generator=gen)
        index[3] = torch.tensor([1, 3])
        index[4] = -1
        z, index = z.to(device), index.to(device)
        grad = torch.rand(70, generator=gen, dtype=torch.float64).to(device)
        got, want = kernels[0](z.float(), index), null_swap_margin_torch(z.float(), index)
        d_got = kernels[1](grad, got[1], got[2], 5, torch.float32)
        d_want = null_swap_margin_backward_torch(grad, want[1], want[2], 5, torch.float32)
        return (torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
                and torch.allclose(got[1], want[1], rtol=1e-12, atol=0.0)
                and torch.equal(d_got == 0, d_want == 0) and torch.allclose(d_got, d_want, rtol=1e-6, atol=0.0))

    return first_use_probe(device, "the null swap margin", load, agrees)


class _NullSwapMargin(torch.autograd.Function):
    """`expert_count_surrogate` with a null expert, through one autograd node: the value is the
    count of real experts itself (q - sg(q) is an exact zero); the gradient, written out, is
    g * q(1 - q) on the weakest selected real expert's logit and its negative on the null's, for
    tokens whose top-k holds no null, q = sigmoid(z_w - z_null) in float64 (what autograd
    through the gather, min, sigmoid and where gives). One kernel call each way where
    `_swap_kernels` has kernels for the tensors, else the tensor ops (the definition)."""

    @staticmethod
    def forward(ctx, expert_logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        kernels = _swap_kernels(expert_logits, index)
        if kernels is None:
            runs, slope, weakest = null_swap_margin_torch(expert_logits, index)
        else:
            runs, slope, weakest = kernels[0](expert_logits.contiguous(), index.contiguous())
        ctx.backward_kernel = None if kernels is None else kernels[1]
        ctx.save_for_backward(slope, weakest)
        ctx.dtype, ctx.shape = expert_logits.dtype, expert_logits.shape
        return runs

    @staticmethod
    def backward(ctx, grad):
        slope, weakest = ctx.saved_tensors
        backward = ctx.backward_kernel if grad.dtype == torch.float64 else None
        if backward is None:
            return null_swap_margin_backward_torch(grad, slope, weakest, ctx.shape[-1], ctx.dtype), None
        return backward(grad.contiguous(), slope, weakest, ctx.shape[-1], ctx.dtype), None


def _expert_flops(experts: tuple[torch.Tensor, torch.Tensor] | None, shape: torch.Size, device: torch.device,
                  model: ModelConfig, router: RouterConfig) -> torch.Tensor:
    """Expert MACs per token of `shape` from (logits, index), or the dense FFN's (None)."""
    if experts is None:
        return torch.full(shape, 3.0 * model.d_model * model.d_ff, dtype=torch.float64, device=device)
    kappa_e = 3.0 * model.d_model * expert_width(model, router)
    return kappa_e * expert_count_surrogate(*experts, router.null_expert)


@dataclass
class HardCost:
    """What executes and what is stored for one layer, from hard decisions."""

    attn_key_macs: torch.Tensor
    """(B, T) MACs of q.k and attention-weighted V over the keys actually read."""
    expert_macs: torch.Tensor
    """(B, T) MACs of the experts (or dense FFN) that actually run."""
    kv_bits: torch.Tensor
    """(B, T) bits stored for this token's K and V, metadata included."""
    experts_run: torch.Tensor
    """(B, T) number of real experts run."""

    @property
    def flops(self) -> torch.Tensor:
        return self.attn_key_macs + self.expert_macs


def hard_cost(
    attn_modes: torch.Tensor,
    expert_index: torch.Tensor | None,
    bit_option: torch.Tensor,
    positions: torch.Tensor,
    model: ModelConfig,
    router: RouterConfig,
    batch: MicroBatchCosts | None = None,
) -> HardCost:
    """Hard accounting from integer decisions: attn_modes (B, T, H) in ATTN_MODES order,
    expert_index (B, T, k) with -1 = null (None = dense FFN), bit_option (B, T) index into
    router.bits (or 0 = the uniform width), each with any leading dims (several layers' stacked);
    `batch`: the positions' `micro_batch_costs`."""
    keys = _keys(positions, router) if batch is None else batch.keys  # (B or 1, T, N_MODES)
    per_head = keys.unsqueeze(2).expand(*attn_modes.shape, N_MODES).gather(-1, attn_modes.unsqueeze(-1)).squeeze(-1)
    attn = 2.0 * model.d_head * per_head.sum(-1)
    if expert_index is None:
        runs = torch.ones(attn.shape, dtype=torch.float64, device=attn_modes.device)
        ffn = runs * 3.0 * model.d_model * model.d_ff
    else:
        runs = (expert_index >= 0).sum(-1).double()
        ffn = runs * 3.0 * model.d_model * expert_width(model, router)
    mem = bit_costs(router, model, bit_option.device)[bit_option]
    return HardCost(attn, ffn, mem, runs)


def noise_free_cost(out: RouterOutput, positions: torch.Tensor, model: ModelConfig, router: RouterConfig,
                    batch: MicroBatchCosts | None = None) -> HardCost:
    """Hard cost of the noise-free argmax decisions (what the budget is judged on)."""
    index = None if out.experts is None else out.experts.index
    return hard_cost(out.attn.hard, index, out.bits.hard, positions, model, router, batch)


def budget_fractions(costs: list[LayerCost], positions: torch.Tensor, model: ModelConfig,
                     batch: MicroBatchCosts | None = None) -> torch.Tensor:
    """C_bar = sum_{l,t} c_t^(l) / C_dense per resource (Appendix A), as a (2,) [flops, mem] tensor.

    `costs` holds one LayerCost per layer on this rank (all layers: the budget spans the model);
    `batch`: the positions' `micro_batch_costs` (its dense sums are the denominator).
    """
    sums = _dense_sums(positions, costs[0].flops.shape[0], model) if batch is None else batch.dense_sums
    totals = torch.stack([sum(c.flops.sum() for c in costs), sum(c.mem.sum() for c in costs)])
    return totals / (sums * len(costs))
