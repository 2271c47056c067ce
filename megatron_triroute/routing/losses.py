"""Per-axis balancing losses (Sec. balance) and their weighted sum in Eq. total.

For one axis with options O: f_o is the fraction of decisions whose executed (hard) option is
o, P_o the mean soft probability softmax(z)_o, p_bar = P the marginal option distribution.
For the attention axis the decisions are (token, head) pairs; for the expert axis they are
(token, slot) pairs of the top-k selection, null included as option 0 (ours: the paper
balances every option of every axis; the budget, not this loss, decides how often null wins).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import LossConfig
from .controller import RouterOutput
from .counts import option_counts
from .device_values import device_constant, to_device
from .softmax import softmax


def switch_load_loss(fraction: torch.Tensor, mean_prob: torch.Tensor) -> torch.Tensor:
    """L_bal = |O| * sum_o f_o P_o  (Sec. balance). fraction: (O,) detached; mean_prob: (O,)."""
    return fraction.numel() * (fraction.detach() * mean_prob).sum()


def router_z_loss(logits: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """L_z = mean over decisions of (log sum_o exp z_o)^2  (Sec. balance); `lse`: the decisions'
    log-sum-exp in float32 when already computed."""
    if lse is None:
        lse = torch.logsumexp(logits.float(), dim=-1)
    return lse.pow(2).mean()


def marginal_entropy(mean_prob: torch.Tensor) -> torch.Tensor:
    """H(p_bar) = -sum_o p_bar_o log p_bar_o (natural log)."""
    p = mean_prob.clamp_min(1e-12)
    return -(p * p.log()).sum()


def entropy_floor_loss(mean_prob: torch.Tensor, zeta: float, entropy: torch.Tensor | None = None) -> torch.Tensor:
    """L_ent = [zeta log|O| - H(p_bar)]_+  (Eq. for L_ent, Sec. balance); `entropy`: H(p_bar) when
    already computed."""
    if entropy is None:
        entropy = marginal_entropy(mean_prob)
    return F.relu(zeta * math.log(mean_prob.numel()) - entropy)


def axis_statistics(logits: torch.Tensor, executed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, P): executed-option fractions and mean probabilities over all decisions.

    logits: (..., O); executed: (...,) option ids, or (..., k) for top-k (counted per slot).
    """
    f, probs = _fractions_and_probs(logits, executed)
    return f, probs.mean(0)


def _fractions_and_probs(logits: torch.Tensor, executed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(f (O,), each decision's probabilities (N, O)): `axis_statistics` before the mean."""
    n_opt = logits.shape[-1]
    probs = softmax(logits.float()).reshape(-1, n_opt)
    counts = option_counts(executed, n_opt, torch.float32)
    return counts / counts.sum(), probs


@dataclass(frozen=True)
class _Layout:
    """How a layer's axes stack into one (R, W) block of rows: each axis's decisions as rows, padded
    with -inf to the widest axis's W options (a padded option gets probability 0 exactly)."""

    executed: torch.Tensor
    """(A, 1) float32: each axis's executed decisions (rows, times k for top-k slots)."""
    width: torch.Tensor
    """(A,) float32: each axis's option count |O|."""
    log_width: torch.Tensor
    """(A,) float32: log |O|."""
    real: torch.Tensor
    """(A, W) bool: the axis's own options (not padding)."""
    row_axis: torch.Tensor
    """(R,) int64: each row's axis."""
    row_weight: torch.Tensor
    """(R, 1) float32: 1 / N_a of each row's axis (the mean's weight)."""


@functools.lru_cache(maxsize=32)
def _layout(rows: tuple[int, ...], executed: tuple[int, ...], widths: tuple[int, ...], device: torch.device) -> _Layout:
    """`_Layout` of axes of `rows` decisions, `executed` executed options and `widths` options each, made
    once per shape and device (copied there without a stream synchronise: `device_values.to_device`)."""
    real = torch.arange(max(widths), device=device) < to_device(widths, torch.int64, device).unsqueeze(1)
    row_axis = torch.repeat_interleave(torch.arange(len(rows), device=device), to_device(rows, torch.int64, device),
                                       output_size=sum(rows))
    row_weight = to_device([1.0 / n for n in rows], torch.float32, device)[row_axis].unsqueeze(1)
    return _Layout(to_device(executed, torch.float32, device).unsqueeze(1),
                   to_device(widths, torch.float32, device),
                   to_device([math.log(n) for n in widths], torch.float32, device), real, row_axis, row_weight)


class _BalancingLoss(torch.autograd.Function):
    """sum over a layer's routed axes of alpha L_bal + beta L_z + gamma L_ent (Eq. total's middle
    term) from the axes' logits, through one autograd node: the values of the term functions above,
    computed for every axis at once (the axes' decisions stacked as the rows of one block, padded
    to the widest axis: `_Layout`; the axes of one shape copied in as one group: `_Plan`), and
    their gradient to each axis's logits written out as one expression per decision n,

        dz_n = G p_n * ((g - p_n . g) / N + beta * 2 lse_n / N),
        g = alpha |O| f + gamma * [L_ent > 0] * (log max(P, 1e-12) + 1) * [P >= 1e-12],

    (G the upstream gradient; the chain autograd would run through softmax, mean, logsumexp, pow,
    clamp, log, relu and the weighted sum, including their masks), instead of about forty small
    ops per axis forward and ten backward. Equal to the term functions up to float32 rounding (the
    order of the sums). Also returns the (axes, 4) terms [L_bal, L_z, L_ent, H(p_bar)] for logging
    when asked (not differentiable; L_ent 0 without the floor), else an empty tensor."""

    @staticmethod
    def forward(ctx, cfg: LossConfig, with_terms: bool, executed: tuple[torch.Tensor, ...], *logits: torch.Tensor):
        floor = cfg.use_entropy_floor
        device = logits[0].device
        plan = _plan(tuple((tuple(z.shape), z.dtype, tuple(ex.shape), ex.dtype) for z, ex in zip(logits, executed)),
                     device)
        W = plan.width
        # each group's axes stacked (one copy for all of them), as rows padded to W; the block's
        # axes in `plan.order`, each axis's rows contiguous
        pieces, keys = [], []
        for group in plan.groups:
            z = logits[group.members[0]] if len(group.members) == 1 else torch.stack([logits[a] for a in group.members])
            z = z.float().reshape(-1, group.options)
            pieces.append(z if group.options == W else F.pad(z, (0, W - group.options), value=-math.inf))
            ex = executed[group.members[0]] if len(group.members) == 1 \
                else torch.stack([executed[a] for a in group.members])
            # each axis's executed options counted in its own W slots of one (A W,) histogram
            keys.append(ex.reshape(-1) if group.key_offsets is None else (ex.reshape(len(group.members), -1)
                                                                          + group.key_offsets).view(-1))
        block = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        lay = plan.layout
        probs = softmax(block)  # (R, W)
        lse = torch.logsumexp(block, dim=-1)  # (R,)
        # each axis's mean over its own rows, [P | L_z] as one (A, W + 1) block: a column mean per
        # axis, over each group's (axes, rows, W + 1) view (CUDA's segment_reduce took 37 ms a layer
        # at 32,768 rows a segment)
        both = torch.cat([probs, lse.square().unsqueeze(1)], 1)
        segments = both.split(plan.group_rows) if len(plan.groups) > 1 else (both,)
        means = [seg.view(len(group.members), -1, W + 1).mean(1) for seg, group in zip(segments, plan.groups)]
        means = torch.cat(means) if len(means) > 1 else means[0]
        p, zl = means[:, :W], means[:, W]  # (A, W): P; (A,): L_z
        f = option_counts(torch.cat(keys) if len(keys) > 1 else keys[0], len(logits) * W,
                          torch.float32).view(-1, W) / lay.executed
        bal = lay.width * (f * p).sum(-1)  # L_bal
        parts = [bal, zl]
        if floor or with_terms:
            log_p = p.clamp_min(1e-12).log()
            h = -torch.where(lay.real, p * log_p, 0.0).sum(-1)  # H(p_bar); padding (P = 0) adds nothing
        if floor:
            ent = F.relu(cfg.entropy_floor * lay.log_width - h)
            parts.append(ent)
        # (A, 2 or 3) terms times their weights, summed; the same ops with or without the logged terms
        weights = (cfg.load_weight, cfg.z_weight, cfg.entropy_weight)[:len(parts)]
        total = (torch.stack(parts, -1) * device_constant(weights, torch.float32, bal.device)).sum()
        g = f * (cfg.load_weight * lay.width).unsqueeze(1)  # alpha dL_bal/dP
        if floor:  # + gamma dL_ent/dP: the hinge and the clamp pass a gradient only where active
            active = (ent > 0).unsqueeze(1) & (p >= 1e-12)
            g = g + torch.where(active, log_p.add(1.0).mul_(cfg.entropy_weight), 0.0)
        ctx.save_for_backward(probs, lse, g, lay.row_axis, lay.row_weight)
        ctx.z_weight, ctx.plan = cfg.z_weight, plan
        ctx.dtypes, ctx.shapes = [z.dtype for z in logits], [z.shape for z in logits]
        if with_terms:
            out_terms = torch.stack([bal, zl, ent if floor else torch.zeros_like(h), h], -1)
            if plan.restore is not None:  # the block's order -> the axes' own
                out_terms = out_terms.index_select(0, plan.restore)
        else:
            out_terms = total.new_zeros(0)
        ctx.mark_non_differentiable(out_terms)
        return total, out_terms

    @staticmethod
    def backward(ctx, grad_total, _grad_terms):
        probs, lse, g, row_axis, row_weight = ctx.saved_tensors
        plan = ctx.plan
        W = plan.width
        # elementwise, not a matmul: the backward can run under the step's bf16 autocast
        g = g.index_select(0, row_axis)  # (R, W): each row's axis's g (0 on padding, where p is 0)
        inner = (g - (probs * g).sum(-1, keepdim=True)).add_(lse.view(-1, 1), alpha=2.0 * ctx.z_weight)
        dz = (probs * inner).mul_(row_weight * grad_total)
        grads = [None] * len(ctx.shapes)
        segments = dz.split(plan.group_rows) if len(plan.groups) > 1 else (dz,)
        for seg, group in zip(segments, plan.groups):
            seg = seg.view(len(group.members), -1, W)
            if group.options < W:
                seg = seg[..., :group.options]
            for a, part in zip(group.members, seg.unbind(0)):
                grads[a] = part.view(ctx.shapes[a]).to(ctx.dtypes[a])
        return None, None, None, *grads


@dataclass(frozen=True)
class _Group:
    """Axes whose logits and executed options have the same shapes and dtypes: stacked as one."""

    members: tuple[int, ...]
    """The axes' indices, in their order."""
    options: int
    """Their option count |O|."""
    key_offsets: torch.Tensor | None
    """(members, 1) int64: each member's first histogram slot (its place in the block's order times
    W); None for a lone axis first in the block (no offset)."""


@dataclass(frozen=True)
class _Plan:
    """How `_BalancingLoss` lays a call's axes out: groups of equal shapes, in the order their first
    axis comes, their axes end to end (`order`), each axis's rows contiguous (`layout`)."""

    groups: tuple[_Group, ...]
    order: tuple[int, ...]
    width: int
    """W: the widest axis's option count."""
    group_rows: tuple[int, ...]
    """Each group's rows in the block."""
    layout: _Layout
    """Of the axes in `order`."""
    restore: torch.Tensor | None
    """(A,) int64: each axis's place in `order`; None when `order` is the axes' own."""


@functools.lru_cache(maxsize=32)
def _plan(axes: tuple[tuple, ...], device: torch.device) -> _Plan:
    """`_Plan` of axes given as (logits shape, logits dtype, executed shape, executed dtype), made once
    per signature and device."""
    grouped: dict[tuple, list[int]] = {}
    for a, signature in enumerate(axes):
        grouped.setdefault(signature, []).append(a)
    W = max(shape[-1] for shape, *_ in axes)
    groups, order = [], []
    for members in grouped.values():
        first = len(order)
        offsets = None if first == 0 and len(members) == 1 else \
            to_device([(first + i) * W for i in range(len(members))], torch.int64, device).view(-1, 1)
        groups.append(_Group(tuple(members), axes[members[0]][0][-1], offsets))
        order += members
    rows = tuple(math.prod(axes[a][0][:-1]) for a in order)
    layout = _layout(rows, tuple(math.prod(axes[a][2]) for a in order), tuple(axes[a][0][-1] for a in order), device)
    group_rows = tuple(len(g.members) * math.prod(axes[g.members[0]][0][:-1]) for g in groups)
    restore = None if order == list(range(len(axes))) else \
        to_device([order.index(a) for a in range(len(axes))], torch.int64, device)
    return _Plan(tuple(groups), tuple(order), W, group_rows, layout, restore)


def loss_axes(out: RouterOutput) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """A layer's routed axes the balancing losses read: (name, logits, executed options) each."""
    axes = []
    if out.attn.logits is not None:
        # Token-granular attention has one logit group (H_a = 1) whose decision every head copies.
        h_a = out.attn.logits.shape[2]
        axes.append(("attn", out.attn.logits, out.attn.y[:, :, :h_a].argmax(-1)))
    if out.expert_logits is not None:
        axes.append(("experts", out.expert_logits, out.experts.option))
    if out.bits.logits is not None:
        axes.append(("bits", out.bits.logits, out.bits.y.argmax(-1)))
    return axes


def _balancing_loss(axes: list[tuple[str, torch.Tensor, torch.Tensor]], cfg: LossConfig, with_terms: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_BalancingLoss` over `axes` (`loss_axes` entries): (total, (axes, 4) terms or an empty
    tensor); (0, None) without axes."""
    if not axes:
        return torch.zeros(()), None
    return _BalancingLoss.apply(cfg, with_terms, tuple(ex for _, _, ex in axes), *(z for _, z, _ in axes))


def layers_aux_loss(outs: list[RouterOutput], cfg: LossConfig) -> torch.Tensor:
    """sum over the layers of `outs` of `router_aux_loss`'s total: every layer's axes as segments
    of one block (`_BalancingLoss`), so each axis's terms and gradient are its own, as one layer's."""
    return _balancing_loss([axis for out in outs for axis in loss_axes(out)], cfg, False)[0]


def router_aux_loss(out: RouterOutput, cfg: LossConfig, with_terms: bool = True
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum over routed axes of alpha L_bal + beta L_z + gamma L_ent (the middle term of Eq. total).

    Returns the total and a dict of detached per-axis terms for logging (`with_terms=False`: an
    empty dict, and none of their ops run; the total is the same bit for bit).
    """
    axes = loss_axes(out)
    total, values = _balancing_loss(axes, cfg, with_terms)
    terms: dict[str, torch.Tensor] = {}
    if with_terms and axes:
        for (name, logits, _), (bal, z, ent, entropy) in zip(axes, values.unbind()):
            terms[f"{name}/load"], terms[f"{name}/z"] = bal, z
            terms[f"{name}/entropy_floor"] = ent if cfg.use_entropy_floor else torch.zeros(())
            terms[f"{name}/marginal_entropy"] = entropy / math.log(logits.shape[-1])
    return total, terms
