"""Hugging Face configuration of an exported TriRoute model.

`triroute` holds the whole `TriRouteConfig` tree the checkpoint was trained with (model shape,
router: bits, window, KV group size, experts, top-k, null expert, router width, ...; budget:
prices come with the weights). The usual Hugging Face fields are derived from it. `prices` is the
checkpoint's prices record: {"calibrated", "step", "feasible", "prices"[, "curve"]} (the curve, exported
with --price-curve, serves per-row targets: generate(target_flops=, target_mem=)); calibrated false means
the weights carry prices 0, the plain argmax policy, which the budget does not hold (a checkpoint
exported mid-run without --calibrate).
"""

from transformers import PretrainedConfig


class TriRouteConfig(PretrainedConfig):
    model_type = "triroute"

    def __init__(self, triroute=None, eod_token_id=2, page_size=16, prices=None, **kwargs):
        self.triroute = triroute or {}
        self.prices = prices
        """Whether and when the deployed prices were calibrated (None: exported before the record)."""
        self.eod_token_id = eod_token_id
        self.page_size = page_size
        """KV-cache slots per page of the paged cache."""
        model = self.triroute.get("model", {})
        self.vocab_size = model.get("vocab_size")
        self.hidden_size = model.get("d_model")
        self.num_hidden_layers = model.get("n_layers")
        self.num_attention_heads = model.get("n_heads")
        self.num_key_value_heads = model.get("n_kv_heads")
        self.max_position_embeddings = model.get("seq_len")
        kwargs.setdefault("eos_token_id", eod_token_id)
        kwargs.setdefault("pad_token_id", eod_token_id)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
