"""Per-axis balancing losses (Sec. balance) and their weighted sum in Eq. total.

For one axis with options O: f_o is the fraction of decisions whose executed (hard) option is
o, P_o the mean soft probability softmax(z)_o, p_bar = P the marginal option distribution.
For the attention axis the decisions are (token, head) pairs; for the expert axis they are
(token, slot) pairs of the top-k selection, null included as option 0 (ours: the paper
balances every option of every axis; the budget, not this loss, decides how often null wins).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import LossConfig
from .controller import RouterOutput
from .counts import option_counts
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


class _BalancingLoss(torch.autograd.Function):
    """sum over a layer's routed axes of alpha L_bal + beta L_z + gamma L_ent (Eq. total's middle
    term) from the axes' logits, through one autograd node: the values by the term functions above,
    summed in Eq. total's order (bit for bit what autograd through them gives), and their gradient
    to each axis's logits written out as one expression per decision n,

        dz_n = G p_n * ((g - p_n . g) / N + beta * 2 lse_n / N),
        g = alpha |O| f + gamma * [L_ent > 0] * (log max(P, 1e-12) + 1) * [P >= 1e-12],

    (G the upstream gradient; the chain autograd would run through softmax, mean, logsumexp, pow,
    clamp, log, relu and the weighted sum, including their masks), instead of about forty small
    ops per axis. Also returns the (axes, 4) terms [L_bal, L_z, L_ent, H(p_bar)] for logging when
    asked (not differentiable; L_ent 0 without the floor), else an empty tensor."""

    @staticmethod
    def forward(ctx, cfg: LossConfig, with_terms: bool, executed: tuple[torch.Tensor, ...], *logits: torch.Tensor):
        floor = cfg.use_entropy_floor
        total, terms, saved = None, [], []
        for z, ex in zip(logits, executed):
            f, probs = _fractions_and_probs(z, ex)
            p = probs.mean(0)
            lse = torch.logsumexp(z.float(), dim=-1)
            bal, zl = switch_load_loss(f, p), router_z_loss(z, lse)
            h = marginal_entropy(p) if floor or with_terms else None
            ent = entropy_floor_loss(p, cfg.entropy_floor, h) if floor else None
            parts = [cfg.load_weight * bal, cfg.z_weight * zl] + ([cfg.entropy_weight * ent] if floor else [])
            for part in parts:  # summed in Eq. total's order, term by term
                total = part if total is None else total + part
            g = (cfg.load_weight * z.shape[-1]) * f  # alpha dL_bal/dP
            if floor:  # + gamma dL_ent/dP: the hinge and the clamp pass a gradient only where active
                active = (ent > 0) & (p >= 1e-12)
                g = g + torch.where(active, cfg.entropy_weight * (p.clamp_min(1e-12).log() + 1.0), 0.0)
            if with_terms:
                terms.append(torch.stack([bal, zl, ent if floor else torch.zeros_like(bal), h]))
            saved += [probs, lse, g]
        ctx.save_for_backward(*saved)
        ctx.z_weight, ctx.dtypes, ctx.shapes = cfg.z_weight, [z.dtype for z in logits], [z.shape for z in logits]
        out_terms = torch.stack(terms) if terms else total.new_zeros(0)
        ctx.mark_non_differentiable(out_terms)
        return total, out_terms

    @staticmethod
    def backward(ctx, grad_total, _grad_terms):
        saved, grads = ctx.saved_tensors, []
        for i, (dtype, shape) in enumerate(zip(ctx.dtypes, ctx.shapes)):
            probs, lse, g = saved[3 * i: 3 * i + 3]
            # elementwise, not a matmul: the backward can run under the step's bf16 autocast
            inner = (g - (probs * g).sum(-1, keepdim=True)).add_(lse.view(-1, 1), alpha=2.0 * ctx.z_weight)
            grads.append((probs * inner).mul_(grad_total / probs.shape[0]).view(shape).to(dtype))
        return None, None, None, *grads


def router_aux_loss(out: RouterOutput, cfg: LossConfig, with_terms: bool = True
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum over routed axes of alpha L_bal + beta L_z + gamma L_ent (the middle term of Eq. total).

    Returns the total and a dict of detached per-axis terms for logging (`with_terms=False`: an
    empty dict, and none of their ops run; the total is the same bit for bit).
    """
    axes = []
    if out.attn.logits is not None:
        # Token-granular attention has one logit group (H_a = 1) whose decision every head copies.
        h_a = out.attn.logits.shape[2]
        axes.append(("attn", out.attn.logits, out.attn.y[:, :, :h_a].argmax(-1)))
    if out.expert_logits is not None:
        axes.append(("experts", out.expert_logits, out.experts.option))
    if out.bits.logits is not None:
        axes.append(("bits", out.bits.logits, out.bits.y.argmax(-1)))
    if not axes:
        return torch.zeros(()), {}
    total, values = _BalancingLoss.apply(cfg, with_terms, tuple(ex for _, _, ex in axes), *(z for _, z, _ in axes))
    terms: dict[str, torch.Tensor] = {}
    if with_terms:
        for (name, logits, _), (bal, z, ent, entropy) in zip(axes, values):
            terms[f"{name}/load"], terms[f"{name}/z"] = bal, z
            terms[f"{name}/entropy_floor"] = ent if cfg.use_entropy_floor else torch.zeros(())
            terms[f"{name}/marginal_entropy"] = entropy / math.log(logits.shape[-1])
    return total, terms
