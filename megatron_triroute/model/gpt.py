"""TriRoute GPT: Megatron-Core's GPTModel with TriRoute layers and the routing rows.

The first pipeline stage embeds the tokens and appends the routing rows (psi features, empty
previous-decision features, the global sample index); every layer reads and rewrites them;
the last stage drops them before the output layer. The model owns the budget controller, the
router statistics and the per-step state its layers share.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import TriRouteConfig
from ..routing.budget import BudgetController
from ..routing.reinforce import reward_slots_loss
from ..routing.side_features import TokenTables, static_side_features
from . import routing_rows
from .layer import row_layout
from .spec import get_triroute_block_spec
from .routing_step import RoutingStep
from .step_state import RouterStatistics, RoutingStepState


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
        self.layout = row_layout(triroute)
        tables = tables or TokenTables.uniform(m.vocab_size)
        if tables.log_prob.numel() != m.vocab_size:
            raise ValueError(f"token tables cover {tables.log_prob.numel()} ids but model.vocab_size={m.vocab_size}; "
                             "use the tables saved with the tokenizer the data was built with")
        self.register_buffer("token_log_prob", tables.log_prob.float().clone())
        self.register_buffer("token_word_start", tables.word_start.bool().clone())
        self.eod_id = tables.eod_id
        self.budget = BudgetController(triroute.budget)
        self.router_statistics = RouterStatistics(triroute)
        self.step_state = RoutingStepState(triroute, self.budget, self.router_statistics)
        self.routing_step = RoutingStep(self)
        for layer in self.decoder.layers:
            layer.step_state = self.step_state

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
        r = self.triroute.router
        per_layer = r.attn_routing and r.attn_granularity == "layer_group"
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
    def routing_seq_len(self) -> int:
        """Rows of the tensor passed between pipeline stages: tokens + routing rows."""
        return self.layout.seq_len + self.layout.rows

    def set_routing_step(self, step: int, tau: float) -> None:
        self.step_state.step, self.step_state.tau = step, tau

    def forward(self, tokens: torch.Tensor | None, sample_index: torch.Tensor, labels: torch.Tensor | None = None):
        """tokens, labels: (B, T) (tokens may be None on non-first pipeline stages);
        sample_index: (B,) global sample indices. Returns per-token losses (B, T) when labels
        are given on the last stage, logits (B, T, V) otherwise, or the stage's output tensor."""
        decoder_input = None
        if self.pre_process:
            if tokens.shape[1] != self.layout.seq_len:
                raise ValueError(f"sequence length {tokens.shape[1]} != model.seq_len={self.layout.seq_len}")
            emb = self.embedding(input_ids=tokens, position_ids=None)  # [T, B, d]
            rows = self._initial_rows(tokens, sample_index)
            decoder_input = torch.cat([emb, routing_rows.pack(rows, self.layout, emb.dtype)], 0)
        return super().forward(input_ids=tokens, position_ids=None, attention_mask=None,
                               decoder_input=decoder_input, labels=labels)

    def _initial_rows(self, tokens: torch.Tensor, sample_index: torch.Tensor) -> routing_rows.RoutingRows:
        B, T = tokens.shape
        lay = self.layout
        tables = TokenTables(self.token_log_prob, self.token_word_start, self.eod_id)
        rows = routing_rows.RoutingRows(
            static=static_side_features(tokens, tables, self.triroute.router.max_doc_position),
            decisions=torch.zeros(B, T, lay.n_decision, device=tokens.device),
            sample_index=sample_index.to(tokens.device),
        )
        if lay.reward:
            rows.reward = torch.zeros(B, T, 2, device=tokens.device)
        if lay.leader:
            H = lay.n_heads
            rows.leader_y = torch.zeros(B, T, H, 3, device=tokens.device)
            rows.leader_y_cost = torch.zeros(B, T, H, 3, device=tokens.device)
            rows.leader_hard = torch.zeros(B, T, H, dtype=torch.long, device=tokens.device)
        return rows

    def _postprocess(self, hidden_states, *args, **kwargs):
        if not self.post_process:
            return super()._postprocess(hidden_states, *args, **kwargs)
        tokens, packed = routing_rows.split(hidden_states, self.layout)  # drop the routing rows
        out = super()._postprocess(tokens, *args, **kwargs)
        if self.layout.reward and kwargs.get("labels") is not None and self.training:
            # Deliver each token's LM loss to the REINFORCE decisions of every layer (see reinforce).
            out = reward_slots_loss(out, routing_rows.unpack(packed, self.layout).reward)
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
