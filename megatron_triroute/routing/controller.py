"""The TriRoute controller (Eq. router) and its three decision heads (Alg. 1, lines 1-3).

    h_t = phi_trunk([Norm(x_t); psi_t])  (2-layer GELU MLP, width d_r),  h_hat = RMSNorm(h)
    z^a = W_a h_hat,  z^e = W_e h_hat,  z^b = W_b h_hat   (+ per-axis whitening, Eq. whiten)
    y^a = ST-Gumbel(z^a, tau_a) per head,  (S, p^e) = TopK-softmax(z^e, k),  y^b = ST-Gumbel(z^b, tau_b)

Each axis produces two views of the same straight-through sample: `y` (model path, through
gradient balancing, Eq. gradbal) and `y_cost` (budget path, raw logits), with identical
forward values. `hard` is the noise-free argmax: the decision used at inference and the one
the budget is judged on. In eval mode the executed decision *is* the noise-free argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from triroute_kernels import few_rows

from ..config import TriRouteConfig
from .modes import FULL, N_MODES
from .gating import ExpertRoutes, top_k_gating
from .grad_balance import GradBalance
from .compiled import routing_ops
from .gumbel import one_hot, sample_gumbel
from .noise import NoiseKey
from .softmax import softmax
from .side_features import (
    MODE_FRACTIONS,
    N_STATIC_FEATURES,
    REAL_EXPERT_FRACTION,
    WIDTH_ONE_HOT,
    decision_feature_size,
)
from .trunk_grad import run_forward_pre_hooks, shared_trunk_logits
from .versions import version_key
from .whitening import RunningWhitening

if (MODE_FRACTIONS, REAL_EXPERT_FRACTION, WIDTH_ONE_HOT) != (slice(0, N_MODES), N_MODES, slice(N_MODES + 1, None)):
    raise ImportError("decision_features concatenates psi's decision block in side_features' layout; update both")

AXES = ("attn", "experts", "bits")
_AXIS_ID = {"attn": 0, "experts": 1, "bits": 2}


@dataclass
class AxisDecision:
    """One categorical axis (attention per head, or bits) of one layer."""

    y: torch.Tensor
    """(B, T, [H,] O) executed one-hot; gradient (ST) flows to the head through grad balance."""
    y_cost: torch.Tensor
    """Same forward value as `y` (ST); gradient path for the budget surrogate (REINFORCE: the
    policy probabilities, whose expectation is the surrogate)."""
    hard: torch.Tensor
    """(B, T, [H]) noise-free argmax option: inference decision and budget accounting."""
    logits: torch.Tensor | None = None
    """Raw logits (B, T, [H_a,] O) for the balancing losses; None when the axis is fixed."""
    log_prob: torch.Tensor | None = None
    """REINFORCE only: log pi(executed option), (B, T, [H_a])."""
    constant: int | None = None
    """The option every token takes when the axis is fixed (not routed), None otherwise: a consumer
    may skip reading the tensors (no host read of them)."""


@dataclass
class RouterOutput:
    attn: AxisDecision
    """Attention read modes over ATTN_MODES, expanded to all H query heads."""
    bits: AxisDecision
    """KV bit-width choice over `router.bits` (or the single uniform width)."""
    experts: ExpertRoutes | None
    """Top-k routes; None for a dense FFN."""
    expert_logits: torch.Tensor | None = None
    extra_loss: torch.Tensor | None = None
    """Router-family-specific auxiliary loss (e.g. MoD's causal predictor), added to the
    balancing losses by the layer."""
    decision_block: "DecisionBlock | None" = None
    """psi's decision block of these decisions when it was computed with them (`decode_decisions`)."""


@dataclass(frozen=True)
class DecisionBlock:
    """`decision_features` of one output's decisions, computed with them, and the tensors it was
    computed from: `decision_features` takes it only while the output still holds those same
    tensors (a decision replaced afterwards is read again)."""

    features: torch.Tensor
    sources: tuple[torch.Tensor, ...]
    """(attn.y, experts.index, bits.y) as they were."""

    @staticmethod
    def sources_of(out: "RouterOutput") -> tuple:
        return out.attn.y, out.experts.index if out.experts is not None else None, out.bits.y

    def holds(self, out: "RouterOutput") -> bool:
        attn, index, bits = self.sources
        experts = out.experts
        return attn is out.attn.y and bits is out.bits.y and index is (experts.index if experts is not None else None)


def controller_input_width(d_model: int, n_bits_options: int) -> int:
    """Width of the controller's input [Norm(x); psi]: the residual stream plus the side features."""
    return d_model + N_STATIC_FEATURES + decision_feature_size(n_bits_options)


class Trunk(nn.Module):
    """phi_trunk followed by RMSNorm: Linear -> GELU -> Linear -> RMSNorm (Eq. router)."""

    def __init__(self, d_in: int, d_router: int):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_router)
        self.fc2 = nn.Linear(d_router, d_router)
        self.norm = nn.RMSNorm(d_router)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(F.gelu(self.fc1(x))))


class RouterHead(nn.Module):
    """Linear head; with whitening, z = gain * whiten(W h) + bias (see `whitening`)."""

    def __init__(self, d_router: int, n_out: int, whitening: bool, momentum: float, eps: float):
        super().__init__()
        self.proj = nn.Linear(d_router, n_out, bias=False)
        self.whiten = RunningWhitening(n_out, momentum, eps) if whitening else None
        self.gain = nn.Parameter(torch.ones(n_out)) if whitening else None
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        u = self.proj(h)
        if self.whiten is not None:
            u = self.gain * self.whiten(u)
        return u + self.bias

    def fold_inputs(self) -> tuple[torch.Tensor, ...]:
        """The tensors `folded` reads (a cache of it is keyed on them). Read from the modules'
        own tables (a decode step asks every layer for them)."""
        params, modules = self._parameters, self._modules
        weight = modules["proj"]._parameters["weight"]
        whiten = modules.get("whiten")  # None: no whitening (then not a submodule)
        if whiten is None:
            return weight, params["bias"]
        stats = whiten._buffers
        return weight, params["bias"], params["gain"], stats["mean"], stats["var"]

    def folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, bias) of the same head as one affine map, for evaluation (statistics frozen):
        z = gain (W h - mean) / (std + eps) + bias = (a W) h + (bias - a mean), a = gain / (std + eps)."""
        if self.whiten is None:
            return self.proj.weight, self.bias
        w = self.whiten
        a = self.gain / (w.var.sqrt() + w.eps)
        return self.proj.weight * a.unsqueeze(-1), self.bias - a * w.mean


class TriRouteController(nn.Module):
    """Shared trunk + three heads -> the coupled (attention, expert, bit) policy of one layer.

    `layer_number` is 0-based. Table 4 switches (`router.sharing`, `attn_granularity`,
    `estimator`, `grad_balance`, `whitening`, `null_expert`, `bit_routing`) are read from the
    config; fixed axes (routing off) return constant decisions so callers stay uniform.
    """

    def __init__(self, config: TriRouteConfig, layer_number: int):
        super().__init__()
        model, router = config.model, config.router
        self.config = config
        self.layer_number = layer_number
        self.n_heads = model.n_heads
        self.n_bits = len(router.bits) if router.bit_routing else 1
        d_in = controller_input_width(model.d_model, len(router.bits))

        sizes: dict[str, int] = {}
        self.attn_heads = 0  # H_a: logit groups of the attention head (0 = no attention head)
        if router.attn_routing and self.leads_attention_group:
            self.attn_heads = model.n_heads if router.attn_granularity == "per_head" else 1
            sizes["attn"] = self.attn_heads * N_MODES
        if router.expert_routing:
            sizes["experts"] = router.num_expert_options
        if router.bit_routing:
            sizes["bits"] = len(router.bits)
        self.sizes = sizes

        head = lambda n: RouterHead(router.d_router, n, router.whitening, router.whitening_momentum,
                                    router.whitening_eps)
        self.input_norm = nn.RMSNorm(model.d_model) if sizes else None
        if not sizes:  # nothing routed (Dense, KV-quant-only): no trunk, no unused parameters
            pass
        elif router.sharing == "separate":
            self.trunks = nn.ModuleDict({a: Trunk(d_in, router.d_router) for a in sizes})
            self.heads = nn.ModuleDict({a: head(n) for a, n in sizes.items()})
        else:
            self.trunk = Trunk(d_in, router.d_router)
            if router.sharing == "single_head":
                # One logit vector; every axis reads a prefix of it (shared output subspace).
                self.shared_head = head(max(sizes.values())) if sizes else None
            else:
                self.heads = nn.ModuleDict({a: head(n) for a, n in sizes.items()})
        self.balance = nn.ModuleDict(
            {a: GradBalance(router.grad_balance_momentum, router.grad_balance) for a in sizes}
        )
        self.ops = routing_ops(router.compile)

    @property
    def leads_attention_group(self) -> bool:
        """Whether this layer decides attention (layer_group mode: only each group's first layer)."""
        r = self.config.router
        return r.attn_granularity != "layer_group" or self.layer_number % r.layer_group_size == 0

    # ------------------------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor, side: torch.Tensor) -> dict[str, torch.Tensor]:
        """Raw per-axis logits (B, T, n_axis) from [Norm(x); psi]."""
        if not self.sizes:
            return {}
        if not torch.is_autocast_enabled(hidden.device.type):
            return self._logits(hidden.float(), side.float())
        with torch.autocast(hidden.device.type, enabled=False):  # the router runs in fp32 under bf16 autocast
            return self._logits(hidden.float(), side.float())

    def _logits(self, hidden: torch.Tensor, side: torch.Tensor) -> dict[str, torch.Tensor]:
        sharing = self.config.router.sharing
        folded = sharing == "shared_trunk" and not self.training and not torch.is_grad_enabled()
        if folded:  # evaluation: tokens as the rows of 2-D matmuls, one matmul for every head
            B, T = hidden.shape[:2]
            hidden, side = hidden.reshape(B * T, hidden.shape[-1]), side.reshape(B * T, side.shape[-1])
            if few_rows(hidden):  # a decode step's few float32 rows on a CPU: one C++ call
                z = self._fused_logits(hidden, side).view(B, T, -1)
                return dict(zip(self.sizes, z.split(list(self.sizes.values()), -1)))
        if sharing == "shared_trunk" and not folded:  # the same values, one hand-derived backward
            z = shared_trunk_logits(hidden, side, self.input_norm, self.trunk, [self.heads[a] for a in self.sizes])
            return dict(zip(self.sizes, z.split(list(self.sizes.values()), -1)))
        x = torch.cat([self.input_norm(hidden), side], dim=-1)
        if sharing == "separate":
            return {a: self.heads[a](self.trunks[a](x)) for a in self.sizes}
        h = self.trunk(x)
        if sharing == "single_head":
            u = self.shared_head(h) if self.sizes else None
            return {a: u[..., :n] for a, n in self.sizes.items()}
        run_forward_pre_hooks([*self.heads.values(), *(hd.proj for hd in self.heads.values())])  # read, not called
        weight, bias = self._folded_heads()  # folded: the shared trunk's other case returned above
        z = torch.addmm(bias, h, weight.t()).view(B, T, -1)  # (B, T, sum of the heads' sizes)
        return dict(zip(self.sizes, z.split(list(self.sizes.values()), -1)))

    def _folded_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's `RouterHead.folded` map stacked into one, as (weight (sum of sizes,
        d_router), bias) (rebuilt when a tensor it reads changes: keyed on their storage and
        version counters, `RouterHead.fold_inputs`)."""
        heads = self._modules["heads"]._modules
        key = version_key(t for a in self.sizes for t in heads[a].fold_inputs())
        if getattr(self, "_fold_key", None) != key:
            maps = [self.heads[a].folded() for a in self.sizes]
            self._fold = (torch.cat([w for w, _ in maps]).contiguous(), torch.cat([b for _, b in maps]))
            self._fold_key = key
        return self._fold

    def _fused_logits(self, hidden: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        """(N, sum of the heads' sizes): `_logits`' folded path (input norm, trunk, folded heads)
        in one call, `torch.ops.triroute.controller_logits`, equal to it up to the order of the sums."""
        weight, bias = self._folded_heads()
        m = self._modules
        trunk = m["trunk"]._modules
        fc1, fc2, norm, trunk_norm = (trunk["fc1"]._parameters, trunk["fc2"]._parameters, m["input_norm"],
                                      trunk["norm"])
        eps = lambda norm: norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps  # noqa: E731
        return torch.ops.triroute.controller_logits(
            hidden.contiguous(), side.contiguous(), norm._parameters["weight"], eps(norm), fc1["weight"], fc1["bias"],
            fc2["weight"], fc2["bias"], trunk_norm._parameters["weight"], eps(trunk_norm), weight, bias)

    def forward(
        self,
        hidden: torch.Tensor,
        side: torch.Tensor,
        noise_key: NoiseKey | None = None,
        tau: float = 1.0,
        prev: RouterOutput | None = None,
        decide: bool = True,
    ) -> RouterOutput:
        """hidden: (B, T, d) residual stream entering the layer; side: (B, T, F) psi.

        `decide=False` (evaluation only): the routed axes carry their logits and no decision
        (`AxisDecision.y`, `y_cost`, `hard` None; `experts` None beside `expert_logits`), for a
        caller that takes every decision itself (`pricing.price_decisions` with per-row shifts)."""
        if not decide and (self.training or torch.is_grad_enabled()):
            raise ValueError("decide=False is for evaluation (eval mode, no grad): training needs the decisions")
        router = self.config.router
        B, T = hidden.shape[:2]
        raw = self.logits(hidden, side)
        if "attn" in raw:
            raw["attn"] = raw["attn"].view(B, T, self.attn_heads, N_MODES)  # (B, T, H_a, N_MODES)
        if decide and not self.training and not torch.is_grad_enabled() and tuple(raw) == AXES:
            fused = decode_decisions(raw["attn"], raw["experts"], raw["bits"], self.n_heads, router)
            if fused is not None:
                return fused
        noise = self._noise(raw, noise_key)
        undecided = lambda z: AxisDecision(None, None, None, logits=z)  # noqa: E731
        # gradient balancing's reference, once for the layer's axes (read where a backward can follow)
        reference = self._balance_reference() if raw and (self.training or torch.is_grad_enabled()) else None
        # the logits the model path reads: every axis's gradient balanced in one node (the identity
        # without a backward)
        model_z = dict(zip(raw, GradBalance.balance_all([self.balance[a] for a in raw], list(raw.values()),
                                                        reference))) if raw else {}

        if "attn" in raw:
            attn = _expand_heads(self._categorical("attn", raw["attn"], model_z["attn"], noise, tau), self.n_heads) \
                if decide else undecided(raw["attn"])
        elif router.attn_routing and prev is not None:  # layer_group follower reuses the leader's
            attn = AxisDecision(prev.attn.y, prev.attn.y_cost, prev.attn.hard)
        else:
            attn = _constant_axis((B, T, self.n_heads), FULL, N_MODES, hidden.device)

        if "bits" in raw:
            bits = self._categorical("bits", raw["bits"], model_z["bits"], noise, tau) if decide \
                else undecided(raw["bits"])
        else:
            bits = _constant_axis((B, T), 0, 1, hidden.device)

        experts, expert_logits = None, None
        if "experts" in raw:
            expert_logits = raw["experts"]
            experts = top_k_gating(model_z["experts"], router.top_k, router.null_expert) if decide else None
        return RouterOutput(attn=attn, bits=bits, experts=experts, expert_logits=expert_logits)

    def _balance_reference(self) -> torch.Tensor:
        """Mean running gradient norm over this layer's routed axes (see grad_balance, choice d)."""
        return torch.stack([b.rho for b in self.balance.values()]).mean()

    def _noise(self, raw: dict[str, torch.Tensor], key: NoiseKey | None) -> dict[str, torch.Tensor]:
        """The Gumbel draws of this layer's categorical axes: with a key, every axis in one
        counter-based computation (`NoiseKey.gumbel_axes`); none in eval mode."""
        axes = [a for a in ("attn", "bits") if a in raw]
        if not self.training or not axes:
            return {}
        if key is None:
            return {a: sample_gumbel(raw[a]) for a in axes}
        dtype = raw[axes[0]].dtype
        g = key.gumbel_axes({_AXIS_ID[a]: tuple(raw[a].shape) for a in axes}, dtype, noise_fn=self.ops.noise)
        return {a: g[_AXIS_ID[a]] for a in axes}

    def _categorical(self, axis: str, z: torch.Tensor, z_model: torch.Tensor, noise: dict[str, torch.Tensor],
                     tau: float) -> AxisDecision:
        """ST-Gumbel (or REINFORCE) decision for one axis; z: (B, T, [H_a,] O) raw logits, z_model
        the same gradient-balanced (what the model path's gradient reaches)."""
        hard = z.argmax(-1)
        if not self.training:
            y = one_hot(hard, z.shape[-1], z.dtype)
            return AxisDecision(y, y, hard, logits=z)
        g = noise[axis]
        if self.config.router.estimator == "reinforce":
            sample = (z.detach() + g).argmax(-1)  # Gumbel-max: an exact sample of softmax(z)
            y = one_hot(sample, z.shape[-1], z.dtype)
            log_prob = F.log_softmax(z_model, -1).gather(-1, sample.unsqueeze(-1)).squeeze(-1)
            return AxisDecision(y, softmax(z), hard, logits=z, log_prob=log_prob)
        y, y_cost = self.ops.relax(z_model, z, g, torch.full((), tau, dtype=z.dtype, device=z.device) if self.ops.compiled else tau)
        return AxisDecision(y, y_cost, hard, logits=z)


def _expand_heads(d: AxisDecision, n_heads: int) -> AxisDecision:
    """Token-granular attention (H_a = 1) applies one mode to every query head."""
    if d.y.shape[2] == n_heads:
        return d
    B, T = d.y.shape[:2]
    return AxisDecision(
        y=d.y.expand(B, T, n_heads, d.y.shape[-1]),
        y_cost=d.y_cost.expand(B, T, n_heads, d.y_cost.shape[-1]),
        hard=d.hard.expand(B, T, n_heads),
        logits=d.logits,
        log_prob=d.log_prob,
    )


def _constant_axis(shape: tuple[int, ...], option: int, n_options: int, device) -> AxisDecision:
    hard = torch.full(shape, option, dtype=torch.long, device=device)
    y = one_hot(hard, n_options)
    return AxisDecision(y, y, hard, constant=option)


def decode_decisions(attn_z: torch.Tensor, expert_z: torch.Tensor, bits_z: torch.Tensor, n_heads: int, router,
                     shifts=None) -> RouterOutput | None:
    """Every axis's noise-free decision of a decode step's few float32 rows on a CPU in one C++
    call (`torch.ops.triroute.decode_decisions`), with psi's decision block for the next layer;
    None elsewhere (the tensor ops decide). attn_z (B, T, H_a, N_MODES), expert_z (B, T, E'),
    bits_z (B, T, |bits|) the logits; `shifts`: a step's `pricing.PriceShifts` (None: the plain
    argmax). The same decisions as the eval `_categorical` and `top_k_gating` (with shifts:
    `pricing._price_rows`), the same gates and probabilities up to rounding."""
    if not few_rows(expert_z.flatten(0, 1)):
        return None
    shift = (None, None, None) if shifts is None else (shifts.attn, shifts.expert, shifts.bits)
    decided = torch.ops.triroute.decode_decisions(attn_z, expert_z, bits_z, *shift, router.top_k, router.null_expert)
    return decided_output(attn_z, expert_z, bits_z, decided, n_heads)


def decided_output(attn_z: torch.Tensor, expert_z: torch.Tensor, bits_z: torch.Tensor, decided, n_heads: int) -> RouterOutput:
    """The `RouterOutput` of `torch.ops.triroute.decode_decisions`' nine outputs `decided` for those
    logits (attn_z (B, T, H_a, N_MODES), expert_z, bits_z), with psi's decision block."""
    attn_hard, attn_y, bits_hard, bits_y, probs, option, index, weight, block = decided
    out = RouterOutput(attn=_expand_heads(AxisDecision(attn_y, attn_y, attn_hard, logits=attn_z), n_heads),
                       bits=AxisDecision(bits_y, bits_y, bits_hard, logits=bits_z),
                       experts=ExpertRoutes(probs, index, weight, option), expert_logits=expert_z)
    out.decision_block = DecisionBlock(block, DecisionBlock.sources_of(out))
    return out


def decision_features(out: RouterOutput | None, batch: int, seq: int, n_bits_options: int,
                      top_k: int, device=None) -> torch.Tensor:
    """psi's previous-layer block (see side_features): (B, T, N_MODES + 1 + |bits|), detached.

    Reads the executed decisions. `n_bits_options` is len(router.bits); with bit routing off
    the uniform width has no one-hot slot and the bit block stays zero.
    """
    if out is None:
        return torch.zeros(batch, seq, decision_feature_size(n_bits_options), device=device)
    if out.decision_block is not None and out.decision_block.holds(out):
        return out.decision_block.features
    # One concatenation in the block's layout (MODE_FRACTIONS, REAL_EXPERT_FRACTION, WIDTH_ONE_HOT).
    detached = lambda t: t.detach() if t.requires_grad else t  # noqa: E731  (no op where nothing tracks it)
    modes = detached(out.attn.y).float().mean(2)
    if out.experts is not None:
        real = (out.experts.index >= 0).sum(-1, keepdim=True, dtype=torch.float32) / top_k
    else:
        real = modes.new_ones(batch, seq, 1)
    if out.bits.y.shape[-1] == n_bits_options:
        width = detached(out.bits.y).float()
    else:
        width = modes.new_zeros(batch, seq, n_bits_options)
    return torch.cat([modes, real, width], -1)
