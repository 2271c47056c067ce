"""Dense -> native `LlamaForCausalLM` (no remote code), and back.

Our Dense system computes exactly Llama's function: pre-norm RMSNorm (eps 1e-5, computed in
fp32, weight only), rotary embedding in the non-interleaved (rotate-half) form with base 10000
on the whole head, grouped-query attention with the 1/sqrt(d_h) scale and no biases, SwiGLU
w2(silu(w1 x) * w3 x) = down(silu(gate x) * up x), a final RMSNorm and an untied LM head.
Megatron's fused QKV (per KV group: G query heads | k | v) is split into q/k/v_proj by the
inference loader already; the engine's wq (H, d_h, D) is q_proj (H d_h, D) row-major, wo
(D, H, d_h) is o_proj (D, H d_h). What Llama has no place for and Dense does not use (the
controller, whose decisions are constant in Dense, the prices, the token tables) goes to
`triroute_state.safetensors` beside the weights so `--import` can rebuild the checkpoint bit-exactly.

The engine stores Dense K/V in float16 (the 16-bit cache the cost model counts); Llama keeps
them at compute precision, so logits agree to float16 rounding of K/V, not to the last bit.

MoE-only is not exported as Mixtral: its gate is the TriRoute controller, a trunk over
[RMSNorm(x); side features] (document position, word distance, surprisal, previous layer's
decisions) with running whitening and a null expert, not Mixtral's linear softmax top-k over
the hidden state alone; no Mixtral weights reproduce it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import TriRouteConfig
from .safetensors_io import _own, write_weights

SIDE_FILE = "triroute_state.safetensors"


def engine_to_llama(config: TriRouteConfig, state: dict[str, torch.Tensor]):
    """(Llama state, side state the Llama model does not hold)."""
    m = config.model
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["final_norm.weight"],
           "lm_head.weight": state["lm_head.weight"]}
    used = set(["embed.weight", "final_norm.weight", "lm_head.weight"])
    for L in range(m.n_layers):
        s, d = f"layers.{L}.", f"model.layers.{L}."
        pairs = {"self_attn.q_proj.weight": state[s + "wq"].reshape(m.n_heads * m.d_head, m.d_model),
                 "self_attn.k_proj.weight": state[s + "wk"].reshape(m.n_kv_heads * m.d_head, m.d_model),
                 "self_attn.v_proj.weight": state[s + "wv"].reshape(m.n_kv_heads * m.d_head, m.d_model),
                 "self_attn.o_proj.weight": state[s + "wo"].reshape(m.d_model, m.n_heads * m.d_head),
                 "input_layernorm.weight": state[s + "attn_norm.weight"],
                 "post_attention_layernorm.weight": state[s + "ffn_norm.weight"],
                 "mlp.gate_proj.weight": state[s + "ffn.w1.weight"],
                 "mlp.up_proj.weight": state[s + "ffn.w3.weight"],
                 "mlp.down_proj.weight": state[s + "ffn.w2.weight"]}
        out.update({d + k: v for k, v in pairs.items()})
        used.update(s + n for n in ("wq", "wk", "wv", "wo", "attn_norm.weight", "ffn_norm.weight", "ffn.w1.weight",
                                    "ffn.w3.weight", "ffn.w2.weight"))
    side = {k: v for k, v in state.items() if k not in used}
    return out, side


def llama_to_engine(config: TriRouteConfig, llama: dict[str, torch.Tensor], side: dict[str, torch.Tensor]):
    m = config.model
    out = dict(side)
    out["embed.weight"] = llama["model.embed_tokens.weight"]
    out["final_norm.weight"] = llama["model.norm.weight"]
    out["lm_head.weight"] = llama["lm_head.weight"]
    for L in range(m.n_layers):
        s, d = f"layers.{L}.", f"model.layers.{L}."
        out[s + "wq"] = llama[d + "self_attn.q_proj.weight"].reshape(m.n_heads, m.d_head, m.d_model)
        out[s + "wk"] = llama[d + "self_attn.k_proj.weight"].reshape(m.n_kv_heads, m.d_head, m.d_model)
        out[s + "wv"] = llama[d + "self_attn.v_proj.weight"].reshape(m.n_kv_heads, m.d_head, m.d_model)
        out[s + "wo"] = llama[d + "self_attn.o_proj.weight"].reshape(m.d_model, m.n_heads, m.d_head)
        out[s + "attn_norm.weight"] = llama[d + "input_layernorm.weight"]
        out[s + "ffn_norm.weight"] = llama[d + "post_attention_layernorm.weight"]
        out[s + "ffn.w1.weight"] = llama[d + "mlp.gate_proj.weight"]
        out[s + "ffn.w3.weight"] = llama[d + "mlp.up_proj.weight"]
        out[s + "ffn.w2.weight"] = llama[d + "mlp.down_proj.weight"]
    return out


def llama_config(config: TriRouteConfig, eod: int, tree: dict, prices: dict | None = None) -> dict:
    from ..inference.model import NORM_EPS

    m = config.model
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.d_head, "hidden_act": "silu", "max_position_embeddings": m.seq_len,
        "rms_norm_eps": NORM_EPS, "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": eod, "pad_token_id": eod, "use_cache": True, "dtype": "float32",
        "triroute": config.to_dict(), "eod_token_id": eod,
        "training_config": {k: v for k, v in tree.items() if k != "training_step"}, "training_step": tree["training_step"],
        "prices": prices,
    }


def write_llama(directory: Path, tree: dict, config: TriRouteConfig, state: dict, eod: int, dtype: torch.dtype,
                max_shard_size: int, prices: dict | None = None) -> dict:
    """The Llama weights and the side file into `directory`; returns the config.json to write beside them."""
    from safetensors.torch import save_file

    weights, side = engine_to_llama(config, state)
    write_weights(directory, weights, max_shard_size, lambda name, t: t.to(dtype))
    save_file({k: _own(v) for k, v in side.items()}, str(directory / SIDE_FILE), metadata={"format": "pt"})
    cfg = llama_config(config, eod, tree, prices)
    cfg["dtype"] = str(dtype).replace("torch.", "")
    return cfg
