"""The engine (hard decisions: only the selected work runs) against the Megatron model's eval-mode
forward and against a count by hand, for designed mixed decisions: per-head skip/local/full modes
(local windows cut at their left boundary and clamped at position 0, whole tokens skipping every
head, a kv group read by one token only), K/V written at 2, 4, 8 and 16 bits, top-2 experts with
the null expert; the Megatron model on TP = 1 and TP = 2.

The decisions are set on both sides (a forward hook on the Megatron controller, the engine's
`decide` wrapped), identical everywhere. Compared: attention and expert sub-layer outputs on the
same input, layer-0 output, logits; the engine's cost counters against a count from the decisions
alone (K/V projected for every token, since the cache keeps what later tokens may read; query and
output projections only for reading (token, head) pairs; one score and one value product per key
read; one SwiGLU per real route; bytes at each token's width), and its budgeted attention and
expert MACs against the FLOPs torch's FlopCounterMode counts when the test oracles
(`tests.oracles.hard_attention`, `hard_experts`) execute the same decisions.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute
from tests.inference.test_routed_attention import designed_routes


def _modes(B, T, H):
    """(B, T, H) read modes (0 skip, 1 local, 2 full): mixed across heads, whole tokens where every
    head skips (b + t multiple of 5), and in sequence 1 the last two heads (one kv group) read only
    at t = 6, locally (keys 3..6)."""
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
    index = designed_routes(B, T, E, g)
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


def _hand_counts(cfg, modes, bits, index):
    """One layer's engine counters (MACs, bytes written) from the decisions only, every token valid."""
    from megatron_triroute.routing.cost import expert_width
    from megatron_triroute.routing.quant import kv_bits_per_token

    m, r = cfg.model, cfg.router
    d, D, w = m.d_head, m.d_model, r.window
    B, T, H = modes.shape
    keys = 0
    for b in range(B):
        for t in range(T):
            for h in range(H):
                mode = int(modes[b, t, h])
                keys += 0 if mode == 0 else t + 1 - (max(0, t - w) if mode == 1 else 0)
    reading = int((modes != 0).sum())
    g = r.group_size_for(m)
    return {
        "q_proj": reading * d * D, "o_proj": reading * d * D,
        "k_proj": B * T * m.n_kv_heads * d * D, "v_proj": B * T * m.n_kv_heads * d * D,
        "attn": 2 * d * keys,
        "experts": int((index >= 0).sum()) * 3 * D * expert_width(m, r),
        "bytes_written": sum(kv_bits_per_token(r.bits[int(o)], m.d_kv, g) for o in bits.flatten()) // 8,
    }


def _oracle_flops(cfg, modes, index, weight):
    """FLOPs FlopCounterMode counts while the test oracles execute only the selected work."""
    from megatron_triroute.routing.cost import expert_width
    from tests.oracles import hard_attention, hard_experts, swiglu

    m, r = cfg.model, cfg.router
    B, T, H = modes.shape
    d_e = expert_width(m, r)
    q = torch.randn(B, T, H, m.d_head)
    k, v = torch.randn(2, B, T, m.n_kv_heads, m.d_head)
    experts = [swiglu(torch.randn(m.d_model, d_e), torch.randn(m.d_model, d_e), torch.randn(d_e, m.d_model))
               for _ in range(r.num_experts)]
    with FlopCounterMode(display=False) as attn:
        hard_attention(q, k, v, modes, r.window)
    with FlopCounterMode(display=False) as ffn:
        hard_experts(torch.randn(B * T, m.d_model), index.view(B * T, -1), weight.view(B * T, -1), experts)
    return attn.get_total_flops(), ffn.get_total_flops()


def _megatron_forward(model, tokens, idx):
    """Layer 0's input and output, and the logits, of the eval-mode forward."""
    layer = model.decoder.layers[0]
    captured = {}
    h1 = layer.register_forward_pre_hook(lambda m, a, kw: captured.__setitem__("in", kw["hidden_states"]),
                                         with_kwargs=True)
    h2 = layer.register_forward_hook(lambda m, a, kw, out: captured.__setitem__("out", out[0]), with_kwargs=True)
    model.eval()
    with torch.no_grad():
        logits = model(tokens, idx)
    h1.remove(), h2.remove()
    return captured["in"], captured["out"], logits


def _engine(model, cfg, designed):
    """The engine on the TP = 1 model's weights, its decisions replaced by the designed ones."""
    from megatron_triroute.inference.checkpoint import load_state, map_megatron_state
    from megatron_triroute.inference.model import InferenceModel

    engine = InferenceModel(cfg)
    load_state(engine, map_megatron_state({k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}, cfg))
    modes, bits, index, weight = designed
    for layer in engine.layers:
        def decide(x, side, prev, positions, prices, own=layer.decide):
            b = torch.arange(x.shape[0]).view(-1, 1)
            at = lambda t: t[b, positions]  # the designed decision at each token's position
            return _override(own(x, side, prev, positions, prices), at(modes), at(bits), at(index), at(weight),
                             len(cfg.router.bits))
        layer.decide = decide
    return engine


def _run_engine(engine, tokens):
    """One prefill of every token: logits (B, T, V), layer 0's input and output (B, T, D), the audit."""
    from megatron_triroute.inference.audit import CostAudit
    from megatron_triroute.inference.side_state import SideState

    B, T = tokens.shape
    cache, audit = engine.new_cache(page_size=4, initial_pages=1), CostAudit(engine.config.model.n_layers)
    for r in range(B):
        cache.add_request(r)
    captured = {}
    layer = engine.layers[0]
    h1 = layer.register_forward_pre_hook(lambda m, a: captured.__setitem__("in", a[0]))
    h2 = layer.register_forward_hook(lambda m, a, out: captured.__setitem__("out", out))
    logits, _ = engine.step(tokens, torch.full((B,), T), [SideState() for _ in range(B)], cache, list(range(B)),
                            audit=audit, all_logits=True)
    h1.remove(), h2.remove()
    return logits, captured["in"], captured["out"], audit


@torch.no_grad()
def _sublayers(layer, engine, x, rope, designed, cfg):
    """Attention and expert outputs [T, B, D] of Megatron's layer 0 and the engine's on the same
    normed inputs (the layer output adds them to a much larger residual, so they are compared on
    their own here)."""
    from megatron_triroute.inference.attention import routed_attention
    from megatron_triroute.routing.controller import RouterOutput
    from megatron_triroute.routing.gating import ExpertRoutes

    modes, bits, index, weight = designed
    T, B, D = x.shape
    h = layer.input_layernorm(x)
    y = F.one_hot(modes, 3).float()[:, :, layer.head_slice]
    attn = layer.self_attention(h, y, F.one_hot(bits, len(cfg.router.bits)).float(), rotary_pos_emb=rope)
    h2 = layer.pre_mlp_layernorm(x + attn)
    flat = lambda t: t.transpose(0, 1).reshape(T * B, -1)  # (B, T, k) -> (T*B, k), token-major like h2
    ffn = layer.mlp(h2.reshape(T * B, -1), flat(index), flat(weight)).view(T, B, D)

    e, cache = engine.layers[0], engine.new_cache(page_size=4, initial_pages=1)
    for r in range(B):
        cache.add_request(r)
    pos, ok = torch.arange(T).expand(B, T), torch.ones(B, T, dtype=torch.bool)
    attn_engine = routed_attention(h.transpose(0, 1), e.wq, e.wk, e.wv, e.wo, modes, bits, pos, ok, cache, 0,
                                   list(range(B)), cfg.router.window, None)  # (B, T, D)
    routes = RouterOutput(None, None, ExpertRoutes(None, index, weight, None))
    ffn_engine = e._ffn(h2.transpose(0, 1), routes, None)  # (B, T, D)
    return attn, attn_engine.transpose(0, 1), ffn, ffn_engine.transpose(0, 1)


def _rel_err(a, b):
    assert b.abs().max() > 0
    return ((a - b).abs().max() / b.abs().max()).item()


def _checks(rank, world_size, tp):
    import torch.distributed as dist

    from megatron_triroute.parallel import destroy_parallel

    cfg = tiny_triroute()  # window 3, bits (2, 4, 8, 16), top-2 with the null expert, 4 experts
    assert cfg.router.top_k == 2 and cfg.router.null_expert and cfg.router.window == 3
    assert tuple(cfg.router.bits) == (2, 4, 8, 16)
    T = cfg.model.seq_len
    tokens, _, idx = batch(cfg, n=2, seed=11)
    B = tokens.shape[0]
    designed = _designed(cfg, B, T)
    modes, bits, index, weight = designed
    assert set(modes.unique().tolist()) == {0, 1, 2} and set(bits.unique().tolist()) == {0, 1, 2, 3}
    assert bool((index[..., 0] == -1).any() & (index[..., 1] >= 0).any() & (index < 0).all(-1).any())
    assert bool(((modes == 1) & (torch.arange(T).view(1, T, 1) > cfg.router.window)).any())  # a cut window

    engine = None
    for tp_size in sorted({1, tp}):
        model, _ = build(cfg, tp=tp_size, seed=21)  # the same weights at every TP size
        for layer in model.decoder.layers:
            layer.controller.register_forward_hook(
                lambda m, a, out: _override(out, modes, bits, index, weight, len(cfg.router.bits)))
        if engine is None:
            engine = _engine(model, cfg, designed)
            got_logits, got_in, got_out, audit = _run_engine(engine, tokens)
        x_in, x_out, logits = _megatron_forward(model, tokens, idx)
        where = f"tp={tp_size} rank={rank}"
        assert not torch.allclose(x_out[:T], x_in[:T], atol=1e-3), where  # the layer did work
        assert torch.equal(got_in, x_in[:T].transpose(0, 1)), where

        attn, attn_engine, ffn, ffn_engine = _sublayers(model.decoder.layers[0], engine, x_in[:T],
                                                        model.rotary_pos_emb(T), designed, cfg)
        assert _rel_err(attn_engine, attn) < 1e-4, (where, _rel_err(attn_engine, attn))
        assert _rel_err(ffn_engine, ffn) < 1e-4, (where, _rel_err(ffn_engine, ffn))
        want_out = x_out[:T].transpose(0, 1)
        assert torch.allclose(got_out, want_out, atol=1e-5), (where, (got_out - want_out).abs().max())
        if tp_size > 1:  # vocab-sharded on the TP ranks
            parts = [torch.empty_like(logits) for _ in range(tp_size)]
            dist.all_gather(parts, logits.contiguous())
            logits = torch.cat(parts, -1)
        assert torch.allclose(got_logits, logits, atol=1e-4), (where, (got_logits - logits).abs().max())
        destroy_parallel()

    # The engine's counters: every layer ran the designed decisions.
    hand = _hand_counts(cfg, modes, bits, index)
    for layer, counted in enumerate(audit.layers):
        for name, want in hand.items():
            assert counted[name] == want, (layer, name, counted[name], want)
    attn_flops, ffn_flops = _oracle_flops(cfg, modes, index, weight)
    assert attn_flops == 2 * hand["attn"] and ffn_flops == 2 * hand["experts"], (attn_flops, ffn_flops, hand)


@pytest.mark.distributed
def test_engine_equals_megatron_and_hand_counts_on_designed_decisions():
    run_distributed(_checks, 2, 2, timeout=300)
