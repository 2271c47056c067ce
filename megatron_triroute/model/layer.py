"""The TriRoute transformer layer: controller -> routed attention -> experts (Alg. 1, one layer).

    out = controller(x, [psi; previous layer's decisions])   per token: attention modes, KV bits, experts
    x = x + Attn(Norm(x))  read in per-head modes, K/V written at the chosen bit-width
    x = x + FFN(Norm(x))   through the selected experts (null = nothing runs)

Megatron-Core's TransformerBlock builds it from the ModuleSpec of `spec.py` with Megatron's layer
constructor (config, submodules, layer_number, ...). The thin block (`block.py`) calls it as
(hidden_states, RoutingInputs, RoutingState) -> (hidden_states, the next layer's RoutingState), the
typed per-micro-batch values of `routing/state.py`. What is constant within an optimizer step (the
noise key's step, the temperature, the budget, the statistics, an evaluation pass's prices) it
reads from the routing step's state (`routing_step.py`).

Tensor parallel: the controller is replicated and sees the same tokens on every TP rank, so its
decisions are identical there. Each rank uses only its heads' decisions, so the decisions enter
the model through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce
backward): the gradient reaching the controller is the sum of every rank's part, identical on
all ranks. The expert route weights are the exception: the expert layer decodes every token on every
rank (DeepSpeed all-gathers the expert outputs first), so their gradient is already whole and they
enter without the all-reduce. Auxiliary and budget losses are computed from the raw outputs on every rank alike
and are attached to the layer output with Megatron's MoEAuxLossAutoScaler, so layers on
non-last pipeline stages still reach the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import BaseTransformerLayer, get_transformer_layer_offset

from ..config import TriRouteConfig
from ..routing.modes import ATTN_MODES, FULL
from ..routing.controller import RouterOutput
from ..routing.factory import build_controller
from ..routing.cost import MicroBatchCosts, budget_fractions, hard_cost, layers_expected_cost
from ..routing.pricing import price_decisions
from ..routing.losses import layers_aux_loss
from ..routing.gumbel import one_hot
from ..routing.softmax import softmax
from ..routing.noise import NoiseKey
from ..routing.reinforce import RewardBaseline, reward_tap
from ..routing.state import RoutingInputs, RoutingState, has_reward
from .routing_step import RoutingStepState


@dataclass
class TriRouteLayerSubmodules:
    input_layernorm: ModuleSpec | type
    self_attention: ModuleSpec | type
    pre_mlp_layernorm: ModuleSpec | type
    mlp: ModuleSpec | type


class TriRouteTransformerLayer(MegatronModule, BaseTransformerLayer):
    def __init__(self, config: TransformerConfig, submodules: TriRouteLayerSubmodules, layer_number: int = 1,
                 triroute: TriRouteConfig | None = None, pg_collection=None, vp_stage=None, **unused):
        super().__init__(config=config)
        assert triroute is not None, "TriRouteTransformerLayer needs the TriRoute config (spec params)"
        self.triroute = triroute
        self.layer_number = layer_number + get_transformer_layer_offset(config, vp_stage)  # 1-based, global
        self.controller = build_controller(triroute, self.layer_number - 1)
        d = triroute.model.d_model
        self.input_layernorm = build_module(submodules.input_layernorm, config=config, hidden_size=d,
                                            eps=config.layernorm_epsilon)
        self.self_attention = build_module(submodules.self_attention, config=config, triroute=triroute,
                                           layer_number=layer_number)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config=config, hidden_size=d,
                                              eps=config.layernorm_epsilon)
        self.mlp = build_module(submodules.mlp, config=config, triroute=triroute)
        self.step_state: RoutingStepState | None = None  # attached by the model after building
        self.reward_baseline = RewardBaseline() if has_reward(triroute) else None
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        heads_local = triroute.model.n_heads // config.tensor_model_parallel_size
        self.head_slice = slice(tp_rank * heads_local, (tp_rank + 1) * heads_local)

    def forward(self, hidden_states: torch.Tensor, inputs: RoutingInputs, state: RoutingState,
                rotary_pos_emb=None, deferred: list | None = None) -> tuple[torch.Tensor, RoutingState]:
        """hidden_states [T, B, d] -> (hidden_states [T, B, d], the routing state for the next layer).

        In training the layer's auxiliary and budget losses (`routing_loss`) ride its output and it
        records its router statistics (`_record`); given `deferred` (the block's loop in training),
        it appends its router output there instead, and the caller does both for all its layers at
        once (`finish_routing`)."""
        cfg, step = self.triroute, self.step_state
        x = hidden_states
        B, T = inputs.psi.shape[:2]
        positions = inputs.positions  # (T,) 0 .. T-1

        # --- controller (Alg. 1, lines 1-3) ------------------------------------------------
        side = torch.cat([inputs.psi, state.decisions], -1)
        key = NoiseKey(cfg.seed, step.step, self.layer_number - 1, inputs.sample_index, positions,
                       lambda: inputs.noise_words)
        out = self.controller(x.transpose(0, 1), side, key, step.tau, state.leader_output())
        if not self.training and cfg.router.kind == "triroute" and step.prices is not None:
            out = price_decisions(out, step.prices, positions, cfg.model, cfg.router)  # the deployed policy

        # --- routed attention (line 4: reads in per-head modes, K/V written at the chosen bits)
        modes = None if out.attn.constant == FULL else \
            tensor_parallel.copy_to_tensor_model_parallel_region(out.attn.y)[:, :, self.head_slice]
        bit_weights = tensor_parallel.copy_to_tensor_model_parallel_region(out.bits.y)
        attn = self.self_attention(self.input_layernorm(x), modes, bit_weights, rotary_pos_emb=rotary_pos_emb)
        x = x + attn

        # --- experts (null = nothing runs) ---------------------------------------------------
        h = self.pre_mlp_layernorm(x)
        if out.experts is None:
            ffn = self.mlp(h)
        else:
            # No copy_to_tensor_model_parallel_region here: DeepSpeed's MOELayer all-gathers the expert
            # outputs over the tensor-parallel ranks before its weighted decode, so every rank already
            # holds the full gradient of the route weights; an all-reduce would multiply it by tp.
            weight = out.experts.weight
            flat = lambda t: t.transpose(0, 1).reshape(T * B, -1)  # (B, T, k) -> (T*B, k), token-major like h
            ffn = self.mlp(h.reshape(T * B, -1), flat(out.experts.index), flat(weight)).view(T, B, -1)
        x = x + ffn

        # --- losses and statistics (lines 5-6) -------------------------------------------------
        costs = inputs.costs(cfg.model, cfg.router)  # the cost model's per-micro-batch constants
        if deferred is not None:
            deferred.append(out)
        else:
            if self.training:
                x = MoEAuxLossAutoScaler.apply(x, self.routing_loss([out], positions, costs))
            if step.should_record(self.training):
                self._record([out], positions, costs, observe_budget=self.training)

        # --- the routing state the next layer reads -------------------------------------------
        reward = state.reward
        if reward is not None and self.training:
            reward = reward_tap(reward, out, self.reward_baseline)
        return x, state.after(out, cfg, reward)

    def routing_loss(self, outs: list[RouterOutput], positions: torch.Tensor, costs: MicroBatchCosts) -> torch.Tensor:
        """alpha L_bal + beta L_z + gamma L_ent of the layers whose router outputs are `outs` (each
        layer's axes its own, computed in one block: `layers_aux_loss`), plus their share of
        sum_r lambda_r C_r (Eq. total): C_r is linear in the per-layer costs, so S layers add
        lambda_r * sum_{l,t} c_r / (L * sum_t dense_r)."""
        cfg = self.triroute
        aux = layers_aux_loss(outs, cfg.losses)
        for out in outs:
            if out.extra_loss is not None:
                aux = aux + out.extra_loss
        if not cfg.budget.enabled:
            return aux
        # The layers' share of C_r (Appendix A): their surrogate cost (summed over the S layers, computed
        # in one pass) over the dense cost of all L layers. penalty() also subtracts lambda_r C*_r once:
        # a constant with no gradient.
        frac = budget_fractions([layers_expected_cost(outs, positions, cfg.model, cfg.router, costs)], positions,
                                cfg.model, costs)
        share = self.step_state.budget.penalty(frac / cfg.model.n_layers)
        return aux + share.to(aux.dtype)

    @torch.no_grad()
    def _record(self, outs: list[RouterOutput], positions: torch.Tensor, costs: MicroBatchCosts,
                observe_budget: bool) -> None:
        """Add the router statistics of S consecutive layers, this one first, whose outputs are
        `outs` to their rows of the statistics (their decisions stacked: one pass for all S)."""
        cfg, stats = self.triroute, self.step_state.statistics
        sl = stats.slices()
        S = len(outs)
        stack = lambda get: torch.stack([get(o) for o in outs]) if S > 1 else get(outs[0]).unsqueeze(0)  # noqa: E731
        first = outs[0]
        attn = stack(lambda o: o.attn.hard)  # (S, B, T, H)
        B, T = attn.shape[1:3]
        f64 = dict(dtype=torch.float64, device=attn.device)

        def where_present(get, reduce):
            """reduce(stacked) over the layers whose `get` is not None (a layer-group follower has
            no attention logits), zeros in the other layers' rows; None when no layer has it."""
            have = [i for i, o in enumerate(outs) if get(o) is not None]
            if len(have) == S:
                return reduce(stack(get))
            if not have:
                return None
            values = reduce(torch.stack([get(outs[i]) for i in have]))
            return values.new_zeros(S, values.shape[-1]).index_copy_(0, torch.tensor(have, device=attn.device), values)

        parts = {"tokens": torch.full((S, 1), float(B * T), **f64)}  # in the row's layout order
        parts["attn/fraction"] = one_hot(attn, len(ATTN_MODES), torch.float64).sum((1, 2, 3)) / attn.shape[3]
        parts["attn/prob"] = where_present(lambda o: o.attn.logits, lambda z: softmax(z.double()).mean(3).sum((1, 2)))
        if first.experts is not None:
            n = first.experts.probs.shape[-1]
            parts["experts/fraction"] = (one_hot(stack(lambda o: o.experts.option), n, torch.float64).sum((1, 2, 3))
                                         / cfg.router.top_k)
            parts["experts/prob"] = stack(lambda o: o.experts.probs).double().sum((1, 2))
        bits = stack(lambda o: o.bits.hard)  # (S, B, T)
        parts["bits/fraction"] = one_hot(bits, stats.n_bits, torch.float64).sum((1, 2))
        parts["bits/prob"] = where_present(lambda o: o.bits.logits, lambda z: softmax(z.double()).sum((1, 2)))
        index = None if first.experts is None else stack(lambda o: o.experts.index)
        hard = hard_cost(attn, index, bits, positions, cfg.model, cfg.router, costs)  # the noise-free decisions'
        cost = torch.stack([hard.flops.sum((1, 2)), hard.kv_bits.sum((1, 2))], -1)  # (S, 2)
        dense_sums = costs.dense_sums
        parts["cost"], parts["dense"] = cost, dense_sums.expand(S, 2)
        # one add over the layers' rows; a slice nothing recorded this micro-batch adds zeros
        row = self.layer_number - 1
        stats.sums[row:row + S].add_(torch.cat(
            [parts[name] if parts.get(name) is not None else torch.zeros(S, s.stop - s.start, **f64)
             for name, s in sl.items()], -1))
        if observe_budget:
            self.step_state.budget.observe(cost.sum(0), dense_sums * S)


def finish_routing(x: torch.Tensor, layer: TriRouteTransformerLayer, outs: list[RouterOutput],
                   inputs: RoutingInputs) -> torch.Tensor:
    """In training, what the layers that deferred it (`outs`, consecutive, `layer` the first) leave
    to the block's loop, done once for all of them: their routing losses riding x into the
    backward, and their router statistics recorded."""
    if not outs:
        return x
    cfg = layer.triroute
    costs = inputs.costs(cfg.model, cfg.router)
    x = MoEAuxLossAutoScaler.apply(x, layer.routing_loss(outs, inputs.positions, costs))
    if layer.step_state.should_record(True):
        layer._record(outs, inputs.positions, costs, observe_budget=True)
    return x
