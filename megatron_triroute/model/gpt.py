"""TriRoute GPT: Megatron-Core's GPTModel with TriRoute layers and typed routing state.

One stage's forward (every pipeline stage is given the micro-batch's tokens):

    inputs = RoutingInputs(psi(tokens), sample_index)
    x, state = embed(tokens), RoutingState.initial     first stage
             | receive(input tensor)                   later stages (stage_wire.py)
    x, state = run_layers(layers, x, inputs, state)    block.py
    send(x, state)                                     not the last stage
    | loss(output_layer(norm(x))) (+ REINFORCE reward slots)   the last stage

The model owns the budget controller (whose `prices` buffer is the checkpoint's copy of the
deployed prices), the router statistics, and the routing step (model/routing_step.py) that owns
the per-step state its layers share.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import TriRouteConfig
from ..routing.budget import BudgetController
from ..routing.reinforce import reward_slots_loss
from ..routing.side_features import TokenTables
from . import stage_wire
from .block import run_layers
from ..routing.state import RoutingInputs, RoutingState, has_leader
from .routing_step import RouterStatistics, RoutingStep
from .spec import get_triroute_block_spec


class TriRouteGPTModel(GPTModel):
    def __init__(self, config: TransformerConfig, triroute: TriRouteConfig, tables: TokenTables | None = None,
                 groups=None, pre_process: bool = True, post_process: bool = True, use_te: bool | None = None):
        m = triroute.model
        super().__init__(
            config=config, transformer_layer_spec=get_triroute_block_spec(triroute, config, groups, use_te),
            vocab_size=m.vocab_size, max_sequence_length=m.seq_len, pre_process=pre_process,
            post_process=post_process, share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        )
        self.triroute = triroute
        self.wire = stage_wire.WireLayout.of(triroute)
        tables = tables or TokenTables.uniform(m.vocab_size)
        if tables.log_prob.numel() != m.vocab_size:
            raise ValueError(f"token tables cover {tables.log_prob.numel()} ids but model.vocab_size={m.vocab_size}; "
                             "use the tables saved with the tokenizer the data was built with")
        self.register_buffer("token_log_prob", tables.log_prob.float().clone())
        self.register_buffer("token_word_start", tables.word_start.bool().clone())
        self.eod_id = tables.eod_id
        self.budget = BudgetController(triroute.budget)
        self.router_statistics = RouterStatistics(triroute)
        self.routing_step = RoutingStep(self, triroute, self.budget, self.router_statistics)
        for layer in self.decoder.layers:
            layer.step_state = self.routing_step.state

    _STAGE_PARTS = ("decoder.", "embedding.", "output_layer.")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Megatron's global description of every tensor (layers by global number, tensor-parallel
        slices, experts by global id). The model-level tensors (token tables, budget multipliers)
        are the same on every rank: global rank 0 writes them."""
        from dataclasses import replace

        import torch.distributed as dist
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        rank = dist.get_rank() if dist.is_initialized() else 0
        per_layer = has_leader(self.triroute)  # only group leaders have the attention head
        stacked = f"{prefix}decoder.layers.controller."
        for key, value in out.items():
            if not isinstance(value, ShardedTensor):
                continue
            if not key[len(prefix):].startswith(self._STAGE_PARTS):
                out[key] = replace(value, replica_id=(0, 0, rank))
            elif per_layer and value.key.startswith(stacked):
                out[key] = _unstack_layer(value, stacked)
        return out

    @property
    def wire_seq_len(self) -> int:
        """First dimension of the tensor passed between pipeline stages: tokens + routing state rows."""
        return self.wire.seq_length

    def forward(self, tokens: torch.Tensor, sample_index: torch.Tensor, labels: torch.Tensor | None = None):
        """tokens, labels: (B, T) (every stage); sample_index: (B,) global sample indices. Returns
        per-token losses (B, T) when labels are given on the last stage, logits (B, T, V)
        otherwise, or the tensor this stage sends the next."""
        B, T = tokens.shape
        if T != self.wire.seq_len:
            raise ValueError(f"sequence length {T} != model.seq_len={self.wire.seq_len}")
        tables = TokenTables(self.token_log_prob, self.token_word_start, self.eod_id)
        inputs = RoutingInputs.of(tokens, sample_index, tables, self.triroute.router.max_doc_position)
        if self.pre_process:
            x = self.embedding(input_ids=tokens, position_ids=None)  # [T, B, d]
            state = RoutingState.initial(self.triroute, B, T, tokens.device)
        else:
            x, state = stage_wire.receive(self.decoder.input_tensor, self.wire)
        rotary_pos_emb = self.rotary_pos_emb(T)
        x, state = run_layers(self.decoder.layers, x, inputs, state, rotary_pos_emb, self.config, self.training)
        if not self.post_process:
            return stage_wire.send(x, state, self.wire)
        out = self._postprocess(hidden_states=self.decoder.final_layernorm(x), input_ids=tokens, position_ids=None,
                                labels=labels, rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=None, rotary_pos_sin=None)
        if state.reward is not None and labels is not None and self.training:
            # Deliver each token's LM loss to the REINFORCE decisions of every layer (see reinforce).
            out = reward_slots_loss(out, state.reward)
        return out


def _unstack_layer(value, stacked: str):
    """A controller tensor under its own per-layer key (`...decoder.layers.<global layer>.controller...`)
    instead of Megatron's stack over layers. With layer-group attention only each group's leader
    has the attention head (and a single shared head differs in size), so a stack over all layers
    would have holes that no layout could load."""
    from dataclasses import replace

    layer = value.global_offset[0]
    return replace(value, key=f"{stacked[:-len('controller.')]}{layer}.controller.{value.key[len(stacked):]}",
                   global_shape=value.global_shape[1:], global_offset=value.global_offset[1:],
                   axis_fragmentations=value.axis_fragmentations[1:], prepend_axis_num=value.prepend_axis_num - 1)
