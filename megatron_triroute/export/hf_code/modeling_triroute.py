"""Hugging Face wrapper of the TriRoute hard-decision inference engine.

The network is the engine's own `InferenceModel` (the `tr_*.py` files are copies of
megatron_triroute's inference and routing modules): a noise-free, priced controller per layer
decides each token's attention mode per head, KV bit-width and experts, and only the selected
computation runs. `TriRouteCache` is the engine's paged cache: each token's K/V stored packed at
its chosen bit-width, and per sequence the routing state the side features need (position,
document start for the EOD reset, word start, last token). Every row of a batch is one sequence;
padding (left or right) is removed before the engine sees it, so a padded row computes what it
computes alone. The engine computes in float32 under `torch.no_grad` (inference only).

A budget per sequence: `generate(..., target_flops=F, target_mem=M)` (fractions of the dense cost,
a number for every row or a list with one per row, None: the model's own) serves each sequence at
its targets with the engine's per-request prices and control (tr_inference_serve_budget.py) from
the price curve in `config.prices["curve"]` (export with --price-curve); `realised_cost(cache)
["sequences"]` is each sequence's realised (FLOPs, memory) over its generated tokens.
"""

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_triroute import TriRouteConfig
from .tr_config import TriRouteConfig as EngineConfig
from .tr_inference_audit import CostAudit
from .tr_inference_model import InferenceModel
from .tr_inference_serve_budget import PriceCurve, RequestBudget, row_prices
from .tr_inference_side_state import SideState
from .tr_routing_side_features import TokenTables


class TriRouteCache(Cache):
    """The engine's paged, precision-segregated KV cache plus each sequence's routing state."""

    is_compileable = False

    def __init__(self, model: InferenceModel, batch_size: int, page_size: int = 16):
        super().__init__(layers=[])
        self.paged = model.new_cache(page_size)
        self.states = [SideState() for _ in range(batch_size)]
        self.rids = list(range(batch_size))
        for rid in self.rids:
            self.paged.add_request(rid)
        self.audit = CostAudit(model.config.model.n_layers)
        """What the engine executed for these sequences (realised FLOPs and KV memory)."""
        self.seen = 0
        """Columns of the (padded) input consumed so far."""
        self.budgets = None
        """Per sequence its RequestBudget (None: every sequence at the model's prices)."""
        self.prompt_cost = None
        """The audit's per-sequence totals after the first forward (the prompt)."""
        self.ended = {}
        """Per sequence that fed back its end-of-sequence token: the audit's totals before that step
        (generate feeds a finished row padding from then on, which its realised cost leaves out)."""

    def __len__(self):
        return len(self.paged.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx=None):
        return None

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.seen + query_length, 0

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("TriRouteCache does not support beam search (its pages are per sequence). "
                                  "Fix: generate with num_beams=1 (greedy or sampling).")

    def memory(self) -> dict:
        """Bytes at rest in the paged cache (`used`, `slack`, `index`)."""
        return self.paged.memory()


class TriRoutePreTrainedModel(PreTrainedModel):
    config_class = TriRouteConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["InferenceLayer"]
    _supports_cache_class = True

    def _init_weights(self, module):
        pass  # every tensor comes from the export; nothing is initialised here


class TriRouteForCausalLM(TriRoutePreTrainedModel, GenerationMixin):
    def __init__(self, config: TriRouteConfig):
        super().__init__(config)
        engine_config = EngineConfig.from_dict(config.triroute).validate()
        vocab = engine_config.model.vocab_size
        self.model = InferenceModel(engine_config, TokenTables.uniform(vocab, config.eod_token_id))
        self.post_init()
        self.model.eval()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is TriRouteCache, made on the first forward

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.lm_head

    def new_cache(self, batch_size: int) -> TriRouteCache:
        return TriRouteCache(self.model, batch_size, self.config.page_size)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, use_cache=True,
                                      target_flops=None, target_mem=None, **kwargs):
        if isinstance(past_key_values, TriRouteCache) and past_key_values.seen:
            input_ids = input_ids[:, past_key_values.seen:]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "past_key_values": past_key_values,
                "use_cache": use_cache, "target_flops": target_flops, "target_mem": target_mem}

    def budgets(self, batch_size: int, target_flops=None, target_mem=None):
        """Per row its RequestBudget for the targets (a number or one per row; None: the model's own),
        or None when no row has one. A target the routing cannot reach raises ValueError."""
        def rows(target):
            values = list(target) if isinstance(target, (list, tuple)) else [target] * batch_size
            if len(values) != batch_size:
                raise ValueError(f"{len(values)} targets for {batch_size} sequences: give one number, or one per row")
            return [None if v is None else float(v) for v in values]

        flops, mem = rows(target_flops), rows(target_mem)
        if all(v is None for v in flops + mem):
            return None
        curve = (self.config.prices or {}).get("curve")
        if curve is None:
            raise ValueError("this export carries no price curve, so it serves only its own budget. Fix: export "
                             "with python -m megatron_triroute.export ... --price-curve")
        curve, own = PriceCurve.from_dict(curve), self.model.host_prices()
        return [None if f is None and m is None else RequestBudget(curve, (f, m), own) for f, m in zip(flops, mem)]

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, labels=None,
                return_dict=None, target_flops=None, target_mem=None, **kwargs):
        if input_ids is None:
            raise ValueError("TriRouteForCausalLM needs input_ids (the controller's side features read the token ids).")
        if self.model.lm_head.weight.dtype != torch.float32:
            raise TypeError(f"the hard-decision engine computes in float32; the model is "
                            f"{self.model.lm_head.weight.dtype}. Fix: from_pretrained(..., dtype=torch.float32).")
        B, n = input_ids.shape
        cache = past_key_values if isinstance(past_key_values, TriRouteCache) else None
        if cache is None:
            cache = self.new_cache(B)
            cache.budgets = self.budgets(B, target_flops, target_mem)
        elif len(cache.states) != B:
            raise ValueError(f"the cache holds {len(cache.states)} sequences, the input {B}")
        mask = torch.ones(B, n, dtype=torch.bool) if attention_mask is None else attention_mask[:, -n:].bool()
        mask = mask.to(input_ids.device)
        # The engine consumes each row's valid tokens packed to the left (right padding).
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
        lengths = mask.sum(1)
        packed = torch.gather(input_ids, 1, order)
        packed = torch.where(torch.arange(n).view(1, n) < lengths.view(B, 1), packed, torch.zeros_like(packed))
        if cache.prompt_cost is not None and n == 1:  # a decode step: a row fed its end token has ended
            for rid, token in zip(cache.rids, packed[:, 0].tolist()):
                if rid not in cache.ended and token == self.config.eos_token_id:
                    cache.ended[rid] = list(cache.audit.requests[rid])
        prices = None if cache.budgets is None else row_prices(cache.budgets, self.model.host_prices())
        logits_packed, _ = self.model.step(packed, lengths, cache.states, cache.paged, cache.rids, cache.audit,
                                           all_logits=True, prices=prices)
        if cache.prompt_cost is None:
            cache.prompt_cost = [list(cache.audit.requests[rid]) for rid in cache.rids]
        elif cache.budgets is not None:
            for rid, budget in zip(cache.rids, cache.budgets):
                if budget is not None and rid not in cache.ended:
                    budget.update(cache.audit.request_totals(rid, cache.prompt_cost[rid]))
        V = logits_packed.shape[-1]
        logits = torch.zeros_like(logits_packed).scatter_(1, order.unsqueeze(-1).expand(B, n, V), logits_packed)
        logits = logits.masked_fill(~mask.unsqueeze(-1), 0.0)
        cache.seen += n
        loss = None
        if labels is not None:
            shift = labels[:, 1:].masked_fill(~mask[:, 1:], -100)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), shift.reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache if use_cache is not False else None)

    @staticmethod
    def realised_cost(cache: TriRouteCache) -> dict:
        """The engine's cost audit of everything `cache`'s sequences ran: realised_flops (executed
        attention-read and expert MACs over the dense model's on the same tokens), realised_mem
        (KV bytes written over a dense 16-bit cache's), the per-kind totals, and `sequences`: per
        row its (realised_flops, realised_mem) over the tokens after its first forward (generated)
        up to the end-of-sequence token it fed back (`config.eos_token_id`), as the engine counts a
        request that stops there."""
        since = cache.prompt_cost or [None] * len(cache.rids)
        sequences = [cache.audit.request_fractions(rid, since[rid], cache.ended.get(rid)) for rid in cache.rids]
        return cache.audit.summary() | {"sequences": sequences}
