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


def switch_load_loss(fraction: torch.Tensor, mean_prob: torch.Tensor) -> torch.Tensor:
    """L_bal = |O| * sum_o f_o P_o  (Sec. balance). fraction: (O,) detached; mean_prob: (O,)."""
    return fraction.numel() * (fraction.detach() * mean_prob).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """L_z = mean over decisions of (log sum_o exp z_o)^2  (Sec. balance)."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


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
    probs = F.softmax(logits.float(), dim=-1).reshape(-1, n_opt)
    counts = option_counts(executed, n_opt, torch.float32)
    return counts / counts.sum(), probs


class _BalancingTerms(torch.autograd.Function):
    """(L_bal, L_z, L_ent, H(p_bar)) of one axis from its logits: the values by the functions above,
    and their gradient to the logits written out as one expression per decision n,

        dz_n = p_n * ((g - p_n . g) / N + dL/dL_z * 2 lse_n / N),
        g = dL/dL_bal * |O| f + dL/dL_ent * [L_ent > 0] * (log max(P, 1e-12) + 1) * [P >= 1e-12],

    (the chain autograd would run through softmax, mean, logsumexp, pow, clamp, log and relu,
    including their masks), instead of about thirty small ops per axis. H(p_bar) is not
    differentiable (logging only); L_ent and H are zeros where not asked for."""

    @staticmethod
    def forward(ctx, logits, executed, zeta: float, floor: bool, entropy: bool):
        f, probs = _fractions_and_probs(logits, executed)
        p = probs.mean(0)
        bal, z = switch_load_loss(f, p), router_z_loss(logits)
        h = marginal_entropy(p) if floor or entropy else None
        ent = entropy_floor_loss(p, zeta, h) if floor else None
        ctx.save_for_backward(logits, f, probs, p, ent if floor else None)
        ctx.floor = floor
        ctx.mark_non_differentiable(*((h,) if h is not None else ()))
        return bal, z, ent if ent is not None else bal.new_zeros(()), h if h is not None else bal.new_zeros(())

    @staticmethod
    def backward(ctx, grad_bal, grad_z, grad_ent, _grad_entropy):
        logits, f, probs, p, ent = ctx.saved_tensors
        n, n_opt = probs.shape
        g = grad_bal * (n_opt * f)  # dL/dP
        if ctx.floor:
            clamped = p.clamp_min(1e-12)
            active = (ent > 0) & (p >= 1e-12)
            g = g + torch.where(active, grad_ent * (clamped.log() + 1.0), 0.0)
        lse = torch.logsumexp(logits.float(), dim=-1).reshape(n, 1)
        # elementwise, not a matmul: the backward can run under the step's bf16 autocast
        inner = (g - (probs * g).sum(-1, keepdim=True)).add_(lse * (grad_z * 2.0)).div_(n)
        return (probs * inner).view(logits.shape).to(logits.dtype), None, None, None, None


def router_aux_loss(out: RouterOutput, cfg: LossConfig, with_terms: bool = True
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum over routed axes of alpha L_bal + beta L_z + gamma L_ent (the middle term of Eq. total).

    Returns the total and a dict of detached per-axis terms for logging (`with_terms=False`: an
    empty dict, and none of their ops run; the total is the same bit for bit).
    """
    terms: dict[str, torch.Tensor] = {}
    total: torch.Tensor | None = None
    axes = []
    if out.attn.logits is not None:
        # Token-granular attention has one logit group (H_a = 1) whose decision every head copies.
        h_a = out.attn.logits.shape[2]
        axes.append(("attn", out.attn.logits, out.attn.y[:, :, :h_a].argmax(-1)))
    if out.expert_logits is not None:
        axes.append(("experts", out.expert_logits, out.experts.option))
    if out.bits.logits is not None:
        axes.append(("bits", out.bits.logits, out.bits.y.argmax(-1)))
    for name, logits, executed in axes:
        bal, z, ent, entropy = _BalancingTerms.apply(logits, executed, cfg.entropy_floor, cfg.use_entropy_floor,
                                                     with_terms)
        parts = [cfg.load_weight * bal, cfg.z_weight * z]
        if cfg.use_entropy_floor:  # without the floor its term is an exact zero: not added
            parts.append(cfg.entropy_weight * ent)
        for part in parts:  # summed in Eq. total's order, term by term
            total = part if total is None else total + part
        if with_terms:
            terms[f"{name}/load"] = bal.detach()
            terms[f"{name}/z"] = z.detach()
            terms[f"{name}/entropy_floor"] = ent.detach() if cfg.use_entropy_floor else torch.zeros(())
            terms[f"{name}/marginal_entropy"] = entropy.detach() / math.log(logits.shape[-1])
    return (torch.zeros(()) if total is None else total), terms
