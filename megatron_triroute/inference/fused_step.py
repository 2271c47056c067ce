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

What the call reads from the modules (each layer's weights, norm epsilons, folded heads' cache) is
read once into a plan and kept while no module, parameter or buffer is assigned anywhere and each
whitening buffer is still its module's own; the cache's are kept by the cache while it reallocates
none (`PagedKVCache.decode_state`). A plain attribute set afterwards (a norm's `eps`) is not seen:
assign its module again, or build the model with it.

A controller that replays decisions drawn elsewhere (it has `real`, the `TriRouteController` that
still runs, and `next_decisions()`, e.g. the decode benchmark's forced schedule) is run the same
way, its decisions given to the call.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Sequence

import torch

from triroute_kernels import few_rows

from ..routing.controller import AXES, RouterOutput, TriRouteController, decided_output, decision_features
from ..routing.modes import reach_by_mode
from ..routing.state import has_leader

_FLOAT32_EPS = torch.finfo(torch.float32).eps
_AXES = list(AXES)
_PER_LAYER = 10
"""`decode_layers`' outputs per layer: the controller's logits, then `decode_decisions`' nine, in
`decided_output`'s order; of those, the hard modes, the modes' one-hots, the widths and the expert ids:"""
_ATTN_HARD, _ATTN_Y, _BITS_HARD, _EXPERT_INDEX = 1, 2, 3, 7


class LayerDecisions(Sequence):
    """Each layer's `RouterOutput` of a fused step, made from the call's tensors when first read
    (a serving step reads none of them)."""

    def __init__(self, tensors: list[torch.Tensor], batch: int, sizes: list[int], n_heads: int):
        self._tensors, self._batch, self._sizes, self._n_heads = tensors, batch, sizes, n_heads
        self._outs: list[RouterOutput | None] = [None] * (len(tensors) // _PER_LAYER)

    def __len__(self) -> int:
        return len(self._outs)

    def hard_stacks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every layer's hard decisions stacked, read from the call's tensors (no `RouterOutput`
        made): modes (layers, B, 1, H), bit options (layers, B, 1), expert ids (layers, B, 1, k)."""
        t, n = self._tensors, _PER_LAYER
        modes = torch.stack(t[_ATTN_HARD::n])  # (layers, B, 1, H_a)
        return (modes.expand(*modes.shape[:3], self._n_heads), torch.stack(t[_BITS_HARD::n]),
                torch.stack(t[_EXPERT_INDEX::n]))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"layer {i} of {len(self)}")
        i %= len(self)
        if self._outs[i] is None:
            layer = self._tensors[_PER_LAYER * i: _PER_LAYER * (i + 1)]
            attn_z, expert_z, bits_z = layer[0].view(self._batch, 1, -1).split(self._sizes, -1)
            attn_z = attn_z.view(self._batch, 1, -1, layer[_ATTN_Y].shape[-1])
            self._outs[i] = decided_output(attn_z, expert_z, bits_z, layer[1:], self._n_heads)
        return self._outs[i]


def _real(controller) -> TriRouteController | None:
    """The `TriRouteController` deciding (or running beside replayed decisions), None otherwise."""
    real = getattr(controller, "real", controller) if hasattr(controller, "next_decisions") else controller
    return real if type(real) is TriRouteController else None


class _Registrations:
    """How many modules, parameters and buffers have been registered or reassigned on any module of
    this process (`torch.nn.modules.module`'s global registration hooks, counted from this module's
    import). A step's plan read at one count still holds the modules' own tensors while the count is
    unchanged: assigning a submodule, parameter or buffer goes through a hook, and so does
    `load_state_dict(assign=True)`; `Module.to` keeps each parameter object (its data swapped in
    place) but replaces buffers, which `_Plan.current` checks one by one."""

    count = 0

    @classmethod
    def hook(cls, *_) -> None:
        cls.count += 1


torch.nn.modules.module.register_module_module_registration_hook(_Registrations.hook)
torch.nn.modules.module.register_module_parameter_registration_hook(_Registrations.hook)
torch.nn.modules.module.register_module_buffer_registration_hook(_Registrations.hook)


class _Plan:
    """What `decode_layers` reads from a model's modules, read once and kept while it stays the
    modules' own (`current`): whether every layer's controller can take the call, and every layer's
    weights, norm epsilons and folded heads' cache, each in one list in the call's order. Reading them
    from the modules' tables every step, with the checks of `fusable`, took about a twentieth of a
    batch-1 step on a CPU."""

    def __init__(self, model):
        self.registrations = _Registrations.count
        self.layers = list(model.layers)
        self.controllers = [layer._modules["controller"] for layer in self.layers]
        replayed = [hasattr(c, "next_decisions") for c in self.controllers]
        self.replayed = all(replayed)
        cfg = model.config
        heads = (1, cfg.model.n_heads)
        reals = [_real(c) for c in self.controllers]
        self.fusable = all(real is not None and real.attn_heads in heads and list(real.sizes) == _AXES
                           for real in reals) and (self.replayed or not any(replayed))
        self.weights, self.eps, self.folds, buffers = [], [], [], []
        if self.fusable:
            for layer in self.layers:
                weights, eps, fold, layer_buffers = _layer_args(layer)
                self.weights += weights
                self.eps += eps
                self.folds += fold
                buffers += layer_buffers
            self.sizes = list(reals[0].sizes.values())
        # the buffers read, as (tables, names, tensors): checked by `current` at C speed (a generator
        # over the 160m model's 72 took a twentieth of a millisecond a step)
        self._tables, self._names, self._tensors = (list(c) for c in zip(*buffers)) if buffers else ([], [], [])

    def current(self) -> bool:
        """Whether this plan still holds its model's own modules and tensors."""
        return self.registrations == _Registrations.count and all(
            map(operator.is_, map(dict.get, self._tables, self._names), self._tensors))


_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, _Plan]" = weakref.WeakKeyDictionary()


def _plan(model) -> _Plan:
    """`model`'s plan, read again when it is no longer current."""
    plan = _PLANS.get(model)
    if plan is None or not plan.current():
        plan = _PLANS[model] = _Plan(model)
    return plan


def fused_plan(model, batch, x: torch.Tensor) -> _Plan | None:
    """The plan `decode_layers` runs this step of `model` with, or None where it cannot (module doc)."""
    B, n, D = x.shape
    cfg = model.config
    if n != 1 or batch.valid is not None or not few_rows(x.view(B, D)) or has_leader(cfg):
        return None
    if cfg.router.sharing != "shared_trunk" or not cfg.router.expert_routing:
        return None
    plan = _plan(model)
    return plan if plan.fusable and all(layer.fused and layer.as_defined for layer in plan.layers) else None


def fusable(model, batch, x: torch.Tensor) -> bool:
    """Whether `decode_layers` can run this step of `model` (module doc)."""
    return fused_plan(model, batch, x) is not None


def _layer_args(layer) -> tuple[list, list, tuple, list]:
    """(weights, eps, folded heads' cache, buffers) of one layer in `decode_layers`' order, read from
    the modules' own tables; buffers: (table, name, tensor) of each buffer read."""
    mods, params = layer._modules, layer._parameters
    real = _real(mods["controller"])
    m = real._modules
    trunk = m["trunk"]._modules
    heads = m["heads"]._modules
    fc1, fc2 = trunk["fc1"]._parameters, trunk["fc2"]._parameters
    weights = [mods["attn_norm"]._parameters["weight"], params["wq"], params["wk"], params["wv"], params["wo"],
               mods["ffn_norm"]._parameters["weight"], m["input_norm"]._parameters["weight"],
               fc1["weight"], fc1["bias"], fc2["weight"], fc2["bias"], trunk["norm"]._parameters["weight"]]
    whiten_eps, buffers = 0.0, []
    for axis in AXES:
        head = heads[axis]
        weights += [head._modules["proj"]._parameters["weight"], head._parameters["bias"]]
        stats = head._modules.get("whiten")
        if stats is not None:
            weights += [head._parameters["gain"], stats._buffers["mean"], stats._buffers["var"]]
            buffers += [(stats._buffers, "mean", weights[-2]), (stats._buffers, "var", weights[-1])]
            whiten_eps = stats.eps
    experts = [e._modules for e in mods["experts"]._modules.values()]
    for name in ("w1", "w3", "w2"):
        weights += [e[name]._parameters["weight"] for e in experts]
    fold = getattr(layer, "_fold_cache", None)
    if fold is None:  # the folded heads, made in the call and kept there while their inputs are unchanged
        with torch.inference_mode(False):  # normal tensors: written again outside inference mode too
            fold = layer._fold_cache = (torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.long))
    norm_eps = lambda norm: norm.eps if norm.eps is not None else _FLOAT32_EPS  # noqa: E731
    eps = [mods["attn_norm"].eps, mods["ffn_norm"].eps, norm_eps(m["input_norm"]), norm_eps(trunk["norm"]), whiten_eps]
    return weights, eps, fold, buffers


def _given(out: RouterOutput, n_bits: int, top_k: int) -> list[torch.Tensor]:
    """The five tensors of a replayed decision as the call takes them: modes (B, 1, H or 1), widths,
    expert index and gates (B, 1, k) (the call reshapes and casts them), psi's decision block (B, 1, F)."""
    block = decision_features(out, out.attn.hard.shape[0], 1, n_bits, top_k)
    return [out.attn.hard, out.bits.hard, out.experts.index, out.experts.weight, block]


def decode_layers(model, x: torch.Tensor, batch, cache,
                  plan: _Plan | None = None) -> tuple[torch.Tensor, Sequence[RouterOutput]]:
    """x (B, 1, D) through every layer of `model` in one call (`fusable` must hold): x after the
    last layer and each layer's decisions. `plan`: this step's `fused_plan` where the caller has it."""
    B, _, D = x.shape
    cfg = model.config
    m, r = cfg.model, cfg.router
    plan = plan or _plan(model)
    given, replayed = [], []
    if plan.replayed:
        for controller in plan.controllers:
            replayed.append(controller.next_decisions())
            given += _given(replayed[-1], len(r.bits), r.top_k)
    sizes = plan.sizes
    pools = cache.layers[0].lists()
    shifts = batch.prices if r.kind == "triroute" else None
    shift = (None, None, None) if shifts is None else (shifts.attn, shifts.expert, shifts.bits)
    out = torch.ops.triroute.decode_layers(
        x.view(B, D), batch.side, batch.cos, batch.sin, batch.rows, batch.t, *shift, plan.weights, plan.folds,
        cache.decode_state(), given, len(plan.layers), r.num_experts, len(pools.bits), sizes, r.whitening, plan.eps,
        reach_by_mode(r.window), pools.bits, pools.group_size, cache.page_size, 1.0 / math.sqrt(m.d_head), r.top_k,
        r.null_expert)
    outs = replayed if replayed else LayerDecisions(out[1:], B, sizes, m.n_heads)
    return out[0].view(B, 1, D), outs
