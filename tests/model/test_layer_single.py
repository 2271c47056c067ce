"""Single-process checks of the TriRoute layer inside Megatron's TransformerBlock."""


import pytest
import torch
import torch.nn.functional as F

from megatron_triroute.experts.stacked import swiglu
from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute


def _force(layer, attn_mode: int, bit_option: int, expert_option: int):
    """Make the controller's decisions constant through huge head biases."""
    with torch.no_grad():
        heads = layer.controller.heads
        b = torch.full_like(heads["attn"].bias, -1e4).view(-1, 3)
        b[:, attn_mode] = 1e4
        heads["attn"].bias.copy_(b.view(-1))
        if "bits" in heads:
            b = torch.full_like(heads["bits"].bias, -1e4)
            b[bit_option] = 1e4
            heads["bits"].bias.copy_(b)
        b = torch.full_like(heads["experts"].bias, -1e4)
        b[expert_option] = 1e4
        heads["experts"].bias.copy_(b)


def _layer_io(model, tokens, sample_index):
    """Input, output and routing arguments (inputs, state) of decoder layer 0 in eval mode."""
    captured = {}
    layer = model.decoder.layers[0]
    h1 = layer.register_forward_pre_hook(lambda m, a, kw: captured.__setitem__("in", kw), with_kwargs=True)
    h2 = layer.register_forward_hook(lambda m, a, kw, out: captured.__setitem__("out", out[0]), with_kwargs=True)
    model.eval()
    with torch.no_grad():
        model(tokens, sample_index)
    h1.remove(), h2.remove()
    kw = captured["in"]
    return kw["hidden_states"], captured["out"], {"inputs": kw["inputs"], "state": kw["state"]}


def _check_recorded_row(cfg, stats, B: int, T: int):
    """Layer 0's statistics row after one training forward with every decision forced (full
    attention on every head, bit option 3, expert option 2 with top-1), by hand, slot by slot."""
    from megatron_triroute.routing.cost import expert_width
    from megatron_triroute.routing.quant import kv_bits_per_token

    m, r = cfg.model, cfg.router
    n, sl = float(B * T), stats.slices()
    expected = torch.zeros(stats.width, dtype=torch.float64)
    expected[sl["tokens"]] = n
    for name, option in (("attn", 2), ("experts", 2), ("bits", 3)):
        expected[sl[f"{name}/fraction"].start + option] = n  # counts (attention: per head, over heads)
        expected[sl[f"{name}/prob"].start + option] = n  # softmax of +-1e4 logits: exactly one-hot
    reads = B * sum(2.0 * m.d_model * (t + 1) for t in range(T))  # every head reads t + 1 keys
    expected[sl["cost"]] = torch.tensor([reads + n * 3.0 * m.d_model * expert_width(m, r),
                                         n * kv_bits_per_token(r.bits[3], m.d_kv, r.group_size_for(m))])
    expected[sl["dense"]] = torch.tensor([reads + n * 3.0 * m.d_model * m.d_ff, n * 2 * m.d_kv * 16])
    assert torch.equal(stats.sums[0], expected), (stats.sums[0], expected)
    assert not stats.sums[1:].any()


def _checks(rank, world_size):
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_triroute.model.layer import TriRouteTransformerLayer

    # --- the spec plugs into Megatron's own block ---------------------------------------------
    cfg = tiny_triroute(top_k=1)
    model, _ = build(cfg)
    assert type(model.decoder) is TransformerBlock
    assert all(type(l) is TriRouteTransformerLayer for l in model.decoder.layers)
    tokens, labels, idx = batch(cfg)
    T = cfg.model.seq_len

    # --- all skip + null: the layer is the identity (the work it then runs is the engine's to
    # count: tests/inference/test_hard_decisions.py) ------------------------------------------------
    layer = model.decoder.layers[0]
    _force(layer, attn_mode=0, bit_option=0, expert_option=0)
    x_in, x_out, routing = _layer_io(model, tokens, idx)
    assert torch.equal(x_out[:T], x_in[:T])

    # --- forced full + 16 bits + one fixed expert (k=1) equals the dense computation ----------
    _force(layer, attn_mode=2, bit_option=3, expert_option=2)  # option 2 = real expert 1
    x_in, x_out, routing = _layer_io(model, tokens, idx)
    x = x_in[:T]
    rope = model.rotary_pos_emb(T)
    att = layer.self_attention
    h = layer.input_layernorm(x)
    W = att.linear_qkv.weight.view(2, 4, 8, 32)  # (kv, q-per-kv + k + v, d_h, d)
    q = torch.einsum("tbd,kgcd->tbkgc", h, W[:, :2]).reshape(T, 2, 4, 8)
    k = torch.einsum("tbd,kcd->tbkc", h, W[:, 2])
    v = torch.einsum("tbd,kcd->tbkc", h, W[:, 3])
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    q, k = apply_rotary_pos_emb(q, rope, att.config), apply_rotary_pos_emb(k, rope, att.config)
    k, v = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    ctx = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True)
    x = x + ctx.permute(2, 0, 1, 3).reshape(T, 2, 32) @ att.linear_proj.weight.T
    x = x + swiglu(layer.pre_mlp_layernorm(x), *layer.mlp.experts.experts.expert(1))
    assert torch.allclose(x_out[:T], x, atol=1e-5), (x_out[:T] - x).abs().max()
    model.train()  # relaxed path with the same forced decisions gives the same layer output
    stats = layer.step_state.statistics
    stats.reset()
    out_train = layer(hidden_states=x_in, rotary_pos_emb=rope, **routing)[0]
    assert torch.allclose(out_train[:T], x, atol=1e-5)
    _check_recorded_row(cfg, stats, B=tokens.shape[0], T=T)

    # --- causality of the whole GPT in training mode (noise on, no-drop) ----------------------
    cfg = tiny_triroute()
    from megatron_triroute.parallel import destroy_parallel

    destroy_parallel()
    model, _ = build(cfg, seed=7)
    model.train()
    t = 5
    changed = tokens.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 3) % cfg.model.vocab_size
    la = model(tokens, idx, labels=labels)
    lb = model(changed, idx, labels=labels)
    assert torch.equal(la[:, : t + 1], lb[:, : t + 1])
    assert not torch.equal(la[:, t + 1 :], lb[:, t + 1 :])


@pytest.mark.distributed
def test_triroute_layer_in_megatron_block_single_process():
    run_distributed(_checks, 1)
