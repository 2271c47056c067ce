"""Dense exports as a native LlamaForCausalLM (no remote code) with logits parity to the engine;
batched generation with padding gives each prompt what it gets alone."""

import json

import pytest
import torch

from tests.export.helpers import engine_logits, engine_model, left_pad, sequences

pytestmark = pytest.mark.distributed  # the checkpoints fixture spawns two gloo ranks


def test_dense_is_native_llama_with_logits_parity(checkpoints, exports):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    config = json.loads((exports["dense_tp2"] / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    assert not list(exports["dense_tp2"].glob("*.py"))
    llama = AutoModelForCausalLM.from_pretrained(exports["dense_tp2"])
    assert type(llama) is LlamaForCausalLM
    engine, eod = engine_model(checkpoints["dense_tp2"])
    seqs = sequences(engine.config.model.vocab_size, eod)
    ids, mask = left_pad(seqs, eod)
    with torch.no_grad():
        got = llama(input_ids=ids, attention_mask=mask).logits
    n = ids.shape[1]
    worst = 0.0
    for b, seq in enumerate(seqs):
        want = engine_logits(engine, seq)
        worst = max(worst, (got[b, n - len(seq):] - want).abs().max().item())
    # The engine stores Dense K/V as float16 (the 16-bit cache); Llama keeps float32.
    assert worst < 2e-3, worst
    # Against a float32 re-computation of the engine's Dense layer, the two agree to summation order.
    exact = llama_vs_exact_reference(llama, engine, seqs, eod)
    assert exact < 1e-4, exact


def llama_vs_exact_reference(llama, engine, seqs, eod) -> float:
    """Max |Llama - a float32 re-computation of the engine's Dense layer|: the reference applies
    the engine's own RMSNorm, rope and SwiGLU modules with plain causal softmax attention."""
    import torch.nn.functional as F

    from megatron_triroute.inference.attention import rope

    m = engine.config.model
    worst = 0.0
    for seq in seqs:
        ids = torch.tensor([seq])
        x = engine.embed(ids)[0]
        pos = torch.arange(len(seq))
        for layer in engine.layers:
            h = layer.attn_norm(x)
            q = rope(torch.einsum("nD,hdD->nhd", h, layer.wq), pos)
            k = rope(torch.einsum("nD,hdD->nhd", h, layer.wk), pos)
            v = torch.einsum("nD,hdD->nhd", h, layer.wv)
            G = m.n_heads // m.n_kv_heads
            k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
            att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 is_causal=True).transpose(0, 1)
            x = x + torch.einsum("nhd,Dhd->nD", att, layer.wo)
            x = x + layer.ffn(layer.ffn_norm(x))
        want = engine.lm_head(engine.final_norm(x))
        with torch.no_grad():
            got = llama(input_ids=ids).logits[0]
        worst = max(worst, (got - want).abs().max().item())
    return worst


def test_llama_batched_generate_with_padding_equals_alone(exports):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exports["dense_tp2"])
    llama = AutoModelForCausalLM.from_pretrained(exports["dense_tp2"])
    prompts = ["The history of the", "A", "def main():\n    x = 1"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    together = llama.generate(**batch, max_new_tokens=8, do_sample=False)
    width = batch["input_ids"].shape[1]
    eod = tok.eos_token_id
    for b, prompt in enumerate(prompts):
        ids = tok(prompt, return_tensors="pt")
        alone = llama.generate(**ids, max_new_tokens=8, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
        row = together[b, width:].tolist()
        cut = alone.index(eod) + 1 if eod in alone else len(alone)
        assert row[:cut] == alone[:cut], prompt
