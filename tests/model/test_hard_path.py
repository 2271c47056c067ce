"""The hard (inference) execution path of the TriRoute layer against the relaxed path and a FLOP
count by hand, for mixed decisions: per-head skip/local/full modes (local windows cut at their
left boundary and clamped at position 0), K/V written at 2, 4, 8 and 16 bits, top-2 experts with
the null expert, on TP = 1 and TP = 2.

The decisions are set by a forward hook on the controller (a fixed pattern that covers every case,
identical on both paths and every rank); the FLOPs are counted with torch's FlopCounterMode and
compared with a count from the decisions alone: K/V projections only for keys some query reads,
query and output projections only for reading (token, head) pairs, one score and one value product
per key read, one SwiGLU per real route.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute


def _modes(B, T, H):
    """(B, T, H) read modes (0 skip, 1 local, 2 full): mixed across heads, whole tokens where every
    head skips (b + t multiple of 5), and in sequence 1 the last two heads (one kv group) read only
    at t = 6, locally, so that group needs the K/V of keys 3..6 and no others."""
    b, t, h = torch.meshgrid(torch.arange(B), torch.arange(T), torch.arange(H), indexing="ij")
    modes = (t + 2 * h + b) % 3
    modes[((b + t) % 5 == 0).expand(B, T, H)] = 0
    modes[1, :, H - 2:] = 0
    modes[1, 6, H - 2:] = 1
    return modes


def _routes(B, T, E):
    """(B, T, 2) expert ids (-1 = null) and renormalised weights: tokens with {null, j}, {j, j'}
    and {null, null}."""
    g = torch.Generator().manual_seed(5)
    first = torch.randint(0, E, (B, T), generator=g)
    second = (first + 1 + torch.randint(0, E - 1, (B, T), generator=g)) % E
    index = torch.stack([first, second], -1)
    t = torch.arange(T).view(1, T).expand(B, T)
    index[..., 0][t % 3 == 0] = -1
    index[..., 1][t % 7 == 6] = -1
    index[..., 0][t % 7 == 6] = -1
    p = torch.rand(B, T, 2, generator=g) + 0.1
    return index, p / p.sum(-1, keepdim=True)


def _designed(cfg, B, T):
    H, E = cfg.model.n_heads, cfg.router.num_experts
    modes = _modes(B, T, H)
    bits = (torch.arange(B).view(B, 1) * 5 + torch.arange(T).view(1, T)) % len(cfg.router.bits)
    index, weight = _routes(B, T, E)
    return modes, bits, index, weight


def _override(out, modes, bits, index, weight, n_bits):
    """The controller's output with its decisions replaced (noise-free one-hots, top-2 routes)."""
    y_attn = F.one_hot(modes, 3).to(out.attn.y.dtype)
    y_bits = F.one_hot(bits, n_bits).to(out.bits.y.dtype)
    attn = dataclasses.replace(out.attn, y=y_attn, y_cost=y_attn, hard=modes)
    bit = dataclasses.replace(out.bits, y=y_bits, y_cost=y_bits, hard=bits)
    option = torch.where(index >= 0, index + 1, torch.zeros_like(index))
    experts = dataclasses.replace(out.experts, index=index, weight=weight.to(out.experts.weight.dtype), option=option)
    return dataclasses.replace(out, attn=attn, bits=bit, experts=experts)


def _hand_flops(cfg, modes, index, heads):
    """FLOPs of the selected work for query heads `heads` (this rank's), from the decisions only."""
    m, r = cfg.model, cfg.router
    d, D, G, w = m.d_head, m.d_model, m.n_heads // m.n_kv_heads, r.window
    B, T, _ = modes.shape
    attn = 0
    for b in range(B):
        for kv in sorted({h // G for h in heads}):
            read = torch.zeros(T, dtype=torch.bool)
            for h in range(kv * G, (kv + 1) * G):
                for t in range(T):
                    mode = int(modes[b, t, h])
                    if mode == 0:
                        continue
                    lo = 0 if mode == 2 else max(0, t - w)
                    n = t + 1 - lo
                    read[lo : t + 1] = True
                    attn += 2 * D * d + 2 * d * n + 2 * n * d + 2 * d * D  # q proj, scores, values, out proj
            attn += 2 * (2 * int(read.sum()) * D * d)  # K and V projections of the keys read
    from megatron_triroute.routing.cost import expert_width

    d_e = expert_width(m, r)
    ffn = int((index >= 0).sum()) * 3 * 2 * D * d_e
    return attn, ffn


def _layer(model, tokens, idx, hard):
    """Layer 0's input, output and routing arguments (inputs, state) in eval mode, and the logits."""
    layer = model.decoder.layers[0]
    captured = {}
    h1 = layer.register_forward_pre_hook(lambda m, a, kw: captured.__setitem__("in", kw), with_kwargs=True)
    h2 = layer.register_forward_hook(lambda m, a, kw, out: captured.__setitem__("out", out[0]), with_kwargs=True)
    model.eval()
    model.routing_step.state.hard_execution = hard
    with torch.no_grad():
        logits = model(tokens, idx)
    h1.remove(), h2.remove()
    kw = captured["in"]
    return kw["hidden_states"], captured["out"], logits, {"inputs": kw["inputs"], "state": kw["state"]}


def _rel_err(a, b):
    assert b.abs().max() > 0
    return ((a - b).abs().max() / b.abs().max()).item()


@torch.no_grad()
def _sublayers(layer, x, rope, modes, bits, index, weight):
    """Attention and expert outputs of `layer` on hard and relaxed paths, same decisions (the layer
    output adds them to a much larger residual, so they are compared on their own here)."""
    T, B, _ = x.shape
    h = layer.input_layernorm(x)
    y = F.one_hot(modes, 3).float()[:, :, layer.head_slice]
    bw = F.one_hot(bits, 4).float()
    att = layer.self_attention
    attn = [att(h, y, bw, bits, rotary_pos_emb=rope, hard=hard) for hard in (True, False)]
    h2 = layer.pre_mlp_layernorm(x + attn[1]).reshape(T * B, -1)
    flat = lambda t: t.transpose(0, 1).reshape(T * B, -1)
    ffn = [layer.mlp(h2, flat(index), flat(weight), hard=hard) for hard in (True, False)]
    return attn[0], attn[1], ffn[0], ffn[1]


def _checks(rank, world_size, tp):
    from megatron_triroute.parallel import destroy_parallel

    cfg = tiny_triroute()  # window 3, bits (2, 4, 8, 16), top-2 with the null expert, 4 experts
    assert cfg.router.top_k == 2 and cfg.router.null_expert and cfg.router.window == 3
    assert tuple(cfg.router.bits) == (2, 4, 8, 16)
    T = cfg.model.seq_len
    tokens, _, idx = batch(cfg, n=2, seed=11)
    B = tokens.shape[0]
    modes, bits, index, weight = _designed(cfg, B, T)
    assert set(modes.unique().tolist()) == {0, 1, 2} and set(bits.unique().tolist()) == {0, 1, 2, 3}
    assert bool((index[..., 0] == -1).any() & (index[..., 1] >= 0).any() & (index < 0).all(-1).any())
    assert bool(((modes == 1) & (torch.arange(T).view(1, T, 1) > cfg.router.window)).any())  # a cut window

    results = {}
    for tp_size in sorted({1, tp}):
        model, groups = build(cfg, tp=tp_size, seed=21)
        for layer in model.decoder.layers:
            layer.controller.register_forward_hook(
                lambda m, a, out: _override(out, modes, bits, index, weight, len(cfg.router.bits)))
        x_in, hard_out, hard_logits, routing = _layer(model, tokens, idx, hard=True)
        _, relaxed_out, relaxed_logits, _ = _layer(model, tokens, idx, hard=False)
        where = f"tp={tp_size} rank={rank}"
        assert not torch.allclose(hard_out[:T], x_in[:T], atol=1e-3), where  # the layer did work

        layer = model.decoder.layers[0]
        rope = model.rotary_pos_emb(T)
        attn_hard, attn_relaxed, ffn_hard, ffn_relaxed = _sublayers(layer, x_in[:T], rope, modes, bits, index, weight)
        assert _rel_err(attn_hard, attn_relaxed) < 1e-4, (where, _rel_err(attn_hard, attn_relaxed))
        assert _rel_err(ffn_hard, ffn_relaxed) < 1e-4, (where, _rel_err(ffn_hard, ffn_relaxed))
        assert torch.allclose(hard_out[:T], relaxed_out[:T], atol=1e-5), (where, (hard_out[:T] - relaxed_out[:T]).abs().max())
        assert torch.allclose(hard_logits, relaxed_logits, atol=1e-4), (where, (hard_logits - relaxed_logits).abs().max())
        model.routing_step.state.hard_execution = True
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            layer(hidden_states=x_in, rotary_pos_emb=rope, **routing)
        by_module = counter.get_flop_counts()
        total = counter.get_total_flops()
        attn_counted, ffn_counted, ctrl_counted = (
            sum(sum(v.values()) for k, v in by_module.items() if k.endswith(name))
            for name in (".self_attention", ".mlp", ".controller"))
        heads = range(groups.tp_rank * cfg.model.n_heads // tp_size, (groups.tp_rank + 1) * cfg.model.n_heads // tp_size)
        attn_hand, ffn_hand = _hand_flops(cfg, modes, index, heads)
        assert ctrl_counted > 0 and total == ctrl_counted + attn_counted + ffn_counted, (where, by_module)
        assert attn_counted == attn_hand, (where, attn_counted, attn_hand)
        assert ffn_counted == ffn_hand, (where, ffn_counted, ffn_hand)
        results[tp_size] = hard_logits
        destroy_parallel()
    if tp > 1:  # TP = 2 hard path gives the TP = 1 model's logits (vocab-sharded on TP ranks)
        import torch.distributed as dist

        full = results[tp]
        parts = [torch.empty_like(full) for _ in range(tp)]
        dist.all_gather(parts, full.contiguous())
        full = torch.cat(parts, -1)
        assert torch.allclose(full, results[1], atol=1e-4), (full - results[1]).abs().max()


@pytest.mark.distributed
def test_hard_path_matches_relaxed_path_and_hand_flop_count():
    run_distributed(_checks, 2, 2, timeout=300)
