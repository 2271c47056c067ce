"""A decode step's layers in one C++ call (`torch.ops.triroute.decode_layers`).

At one token per request a layer's kernels take a few hundred microseconds, and the Python between
them (the controller module, its decision objects, the layer's arguments) took about a sixth of a
step at batch 1 on a CPU. `decode_layers` runs every layer's controller logits (heads folded),
decisions (priced with the step's shifts) and layer ops (`triroute.decode_layer`) in one call, the
same kernels on the same values as `InferenceModel.forward_step` layer by layer (its definition):
the same bits (`tests/inference/test_fused_step.py`).

It is taken where that loop would call the same kernels: a decode step (one valid token per request)
of few float32 rows on a CPU where the C++ kernels are built, every layer with its shared-trunk
controller deciding all three axes and routed experts, no layer groups, no layer's `decide` or
`forward` replaced. Elsewhere the layer loop runs.

A controller that replays decisions drawn elsewhere (it has `real`, the `TriRouteController` that
still runs, and `next_decisions()`, e.g. the decode benchmark's forced schedule) is run the same
way, its decisions given to the call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from triroute_kernels import few_rows

from ..routing.controller import AXES, RouterOutput, TriRouteController, decided_output, decision_features
from ..routing.modes import reach_by_mode
from ..routing.state import has_leader

_FLOAT32_EPS = torch.finfo(torch.float32).eps
_AXES = list(AXES)


class LayerDecisions(Sequence):
    """Each layer's `RouterOutput` of a fused step, made from the call's tensors when first read
    (a serving step reads none of them)."""

    def __init__(self, tensors: list[torch.Tensor], batch: int, sizes: list[int], n_heads: int):
        self._tensors, self._batch, self._sizes, self._n_heads = tensors, batch, sizes, n_heads
        self._outs: list[RouterOutput | None] = [None] * (len(tensors) // 10)

    def __len__(self) -> int:
        return len(self._outs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"layer {i} of {len(self)}")
        i %= len(self)
        if self._outs[i] is None:
            z = self._tensors[10 * i].view(self._batch, 1, -1)
            attn_z, expert_z, bits_z = z.split(self._sizes, -1)
            attn_z = attn_z.view(self._batch, 1, -1, self._tensors[10 * i + 2].shape[-1])
            self._outs[i] = decided_output(attn_z, expert_z, bits_z, self._tensors[10 * i + 1: 10 * i + 10],
                                           self._n_heads)
        return self._outs[i]


def _real(controller) -> TriRouteController | None:
    """The `TriRouteController` deciding (or running beside replayed decisions), None otherwise."""
    real = getattr(controller, "real", controller) if hasattr(controller, "next_decisions") else controller
    return real if type(real) is TriRouteController else None


def fusable(model, batch, x: torch.Tensor) -> bool:
    """Whether `decode_layers` can run this step of `model` (module doc)."""
    B, n, D = x.shape
    cfg = model.config
    if n != 1 or batch.valid is not None or not few_rows(x.view(B, D)) or has_leader(cfg):
        return False
    if cfg.router.sharing != "shared_trunk" or not cfg.router.expert_routing:
        return False
    heads = (1, cfg.model.n_heads)
    for layer in model.layers:
        real = _real(layer._modules["controller"])
        if not layer.fused or not layer.as_defined or real is None or real.attn_heads not in heads or \
                list(real.sizes) != _AXES:
            return False
    return True


def _layer_args(layer, cache) -> tuple[list, list, list]:
    """(weights, state, eps) of one layer in `decode_layers`' order, read from the modules' own tables
    (every layer's, every step: the call holds nothing between steps but the folded heads' cache)."""
    mods, params = layer._modules, layer._parameters
    real = _real(mods["controller"])
    m = real._modules
    trunk = m["trunk"]._modules
    heads = m["heads"]._modules
    fc1, fc2 = trunk["fc1"]._parameters, trunk["fc2"]._parameters
    i = layer.layer_number
    weights = [mods["attn_norm"]._parameters["weight"], params["wq"], params["wk"], params["wv"], params["wo"],
               cache.layer_tables[i], mods["ffn_norm"]._parameters["weight"], m["input_norm"]._parameters["weight"],
               fc1["weight"], fc1["bias"], fc2["weight"], fc2["bias"], trunk["norm"]._parameters["weight"]]
    whiten_eps = 0.0
    for axis in AXES:
        head = heads[axis]
        weights += [head._modules["proj"]._parameters["weight"], head._parameters["bias"]]
        stats = head._modules.get("whiten")
        if stats is not None:
            weights += [head._parameters["gain"], stats._buffers["mean"], stats._buffers["var"]]
            whiten_eps = stats.eps
    experts = [e._modules for e in mods["experts"]._modules.values()]
    for name in ("w1", "w3", "w2"):
        weights += [e[name]._parameters["weight"] for e in experts]
    fold = getattr(layer, "_fold_cache", None)
    if fold is None:  # the folded heads, made in the call and kept there while their inputs are unchanged
        with torch.inference_mode(False):  # normal tensors: written again outside inference mode too
            fold = layer._fold_cache = (torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.long))
    state = [cache.layer_counts[i], cache.layer_executed[i], *fold]
    for group in cache.layers[i].lists().tensors:
        state += group
    norm_eps = lambda norm: norm.eps if norm.eps is not None else _FLOAT32_EPS  # noqa: E731
    eps = [mods["attn_norm"].eps, mods["ffn_norm"].eps, norm_eps(m["input_norm"]), norm_eps(trunk["norm"]), whiten_eps]
    return weights, state, eps


def _given(out: RouterOutput, n_heads: int, n_bits: int, top_k: int) -> list[torch.Tensor]:
    """The five tensors of a replayed decision: modes (N, H), widths (N), expert index and gates
    (N, k), psi's decision block (B, 1, F)."""
    B = out.attn.hard.shape[0]
    N = out.attn.hard.shape[:2].numel()
    block = decision_features(out, B, 1, n_bits, top_k)
    return [out.attn.hard.reshape(N, -1).expand(N, n_heads).long(), out.bits.hard.reshape(N).long(),
            out.experts.index.reshape(N, -1).long(), out.experts.weight.reshape(N, -1).float(), block]


def decode_layers(model, x: torch.Tensor, batch, cache) -> tuple[torch.Tensor, Sequence[RouterOutput]]:
    """x (B, 1, D) through every layer of `model` in one call (`fusable` must hold): x after the
    last layer and each layer's decisions."""
    B, _, D = x.shape
    cfg = model.config
    m, r = cfg.model, cfg.router
    weights, state, eps, given, replayed = [], [], [], [], []
    for layer in model.layers:
        w, s, e = _layer_args(layer, cache)
        weights += w
        state += s
        eps += e
        if hasattr(layer.controller, "next_decisions"):
            replayed.append(layer.controller.next_decisions())
            given += _given(replayed[-1], m.n_heads, len(r.bits), r.top_k)
    if replayed and len(replayed) != len(model.layers):
        raise ValueError("decode_layers: every layer's decisions are replayed, or none")
    real = _real(model.layers[0].controller)
    sizes = list(real.sizes.values())
    pools = cache.layers[0].lists()
    shifts = batch.prices if r.kind == "triroute" else None
    shift = (None, None, None) if shifts is None else (shifts.attn, shifts.expert, shifts.bits)
    out = torch.ops.triroute.decode_layers(
        x.view(B, D), batch.side, batch.cos, batch.sin, batch.rows, batch.t, *shift, weights, state, given,
        len(model.layers), r.num_experts, len(pools.bits), sizes, r.whitening, eps, reach_by_mode(r.window),
        pools.bits, pools.group_size, cache.page_size, 1.0 / math.sqrt(m.d_head), r.top_k, r.null_expert)
    outs = replayed if replayed else LayerDecisions(out[1:], B, sizes, m.n_heads)
    return out[0].view(B, 1, D), outs
