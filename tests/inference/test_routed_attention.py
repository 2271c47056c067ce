"""Routed attention over the paged cache against `tests.oracles.hard_attention` on
fake-quantised K/V, with designed decisions: per-head skip/local/full modes (heads of one KV
group differing), whole tokens skipping every head whose K/V are read later at their width,
local windows cut at t - w, K/V at 2, 4, 8 and 16 bits; as one prefill and token by token. The
cost audit equals `routing.cost.hard_cost` of the same decisions and the bytes at rest equal the
sum of `kv_bits_per_token / 8`."""

import pytest
import torch
import torch.nn.functional as F

from megatron_triroute.inference.attention import rope, routed_attention
from megatron_triroute.inference.audit import CostAudit
from megatron_triroute.inference.engine import InferenceEngine
from megatron_triroute.inference.kv_cache import PagedKVCache
from megatron_triroute.routing.controller import AxisDecision, RouterOutput
from megatron_triroute.routing.cost import hard_cost
from megatron_triroute.routing.gating import ExpertRoutes
from megatron_triroute.routing.quant import fake_quantize, kv_bits_per_token
from tests.oracles import hard_attention
from tests.inference.test_engine import tiny_model

B, T, H, H_KV, D_HEAD, D, W, G = 2, 12, 4, 2, 8, 32, 3, 8
BITS = (2, 4, 8, 16)


def designed():
    """modes (B, T, H), bit options (B, T): token 2 of sequence 0 skips every head at 2 bits and
    token 3 reads it in full; sequence 1 mixes modes inside each KV group."""
    b, t, h = torch.meshgrid(torch.arange(B), torch.arange(T), torch.arange(H), indexing="ij")
    modes = (t + 2 * h + b) % 3
    modes[0, 2] = 0
    modes[0, 3] = 2
    modes[0, 7] = 1  # local at t = 7 > w: keys 4..7 only
    bits = (torch.arange(B).view(B, 1) * 5 + torch.arange(T).view(1, T)) % 4
    bits[0, 2] = 0
    return modes, bits


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3
    return r(B, T, D), r(H, D_HEAD, D), r(H_KV, D_HEAD, D), r(H_KV, D_HEAD, D), r(D, H, D_HEAD)


def reference(h, wq, wk, wv, wo, modes, bits):
    pos = torch.arange(T).repeat(B)
    q = rope(torch.einsum("nD,hdD->nhd", h.reshape(B * T, D), wq), pos).view(B, T, H, D_HEAD)
    k = rope(torch.einsum("nD,hdD->nhd", h.reshape(B * T, D), wk), pos).view(B, T, H_KV, D_HEAD)
    v = torch.einsum("nD,hdD->nhd", h.reshape(B * T, D), wv).view(B, T, H_KV, D_HEAD)
    written = lambda x: torch.stack([torch.stack([
        fake_quantize(x[b, t : t + 1], BITS[int(bits[b, t])], G)[0] if BITS[int(bits[b, t])] < 16
        else x[b, t].half().float() for t in range(T)]) for b in range(B)])
    ctx = hard_attention(q, written(k), written(v), modes, W)  # (B, T, H, d)
    return torch.einsum("bthd,Dhd->btD", ctx, wo)


def run(h, wq, wk, wv, wo, modes, bits, one_by_one):
    cache = PagedKVCache(1, BITS, H_KV, D_HEAD, G, page_size=4, initial_pages=1)
    audit = CostAudit(1)
    for r in range(B):
        cache.add_request(r)
    pos = torch.arange(T).expand(B, T)
    ok = torch.ones(B, T, dtype=torch.bool)
    if not one_by_one:
        return routed_attention(h, wq, wk, wv, wo, modes, bits, pos, ok, cache, 0, [0, 1], W, audit), audit, cache
    outs = [routed_attention(h[:, t : t + 1], wq, wk, wv, wo, modes[:, t : t + 1], bits[:, t : t + 1], pos[:, t : t + 1],
                             ok[:, t : t + 1], cache, 0, [0, 1], W, audit) for t in range(T)]
    return torch.cat(outs, 1), audit, cache


@pytest.mark.parametrize("one_by_one", [False, True])
def test_routed_attention_equals_reference_on_written_kv(one_by_one):
    h, wq, wk, wv, wo = weights()
    modes, bits = designed()
    want = reference(h, wq, wk, wv, wo, modes, bits)
    got, audit, cache = run(h, wq, wk, wv, wo, modes, bits, one_by_one)
    assert (got - want).abs().max() < 1e-5
    assert torch.equal(got[0, 2], torch.zeros(D))  # a token skipping every head does no attention work
    # Keys read: exactly 0 / min(t, w) + 1 / t + 1 per (token, head).
    t = torch.arange(T).view(1, T, 1).expand(B, T, H)
    keys = torch.where(modes == 0, 0, torch.where(modes == 1, t.clamp(max=W) + 1, t + 1))
    assert audit.total("attn") == 2 * D_HEAD * int(keys.sum())
    assert audit.total("q_proj") == audit.total("o_proj") == int((modes != 0).sum()) * D_HEAD * D


def test_prefill_counts_what_decoding_token_by_token_counts():
    h, wq, wk, wv, wo = weights()
    modes, bits = designed()
    prefill, decode = run(h, wq, wk, wv, wo, modes, bits, False)[1], run(h, wq, wk, wv, wo, modes, bits, True)[1]
    assert prefill.layers == decode.layers
    # bytes read: each (token, pool) reads that pool's slots at positions <= t, at the pool's slot size
    slot = {b: kv_bits_per_token(b, H_KV * D_HEAD, G) // 8 for b in BITS}
    t = torch.arange(T)
    want = sum(slot[BITS[o]] * int(((bits[b] == o) & (t <= s)).sum())
               for b in range(B) for s in range(T) for o in range(len(BITS)))
    assert prefill.total("bytes_read") == want


def test_skipped_token_kv_is_read_later_at_its_width_and_window_boundary_is_exact():
    h, wq, wk, wv, wo = weights()
    modes, bits = designed()
    base, _, _ = run(h, wq, wk, wv, wo, modes, bits, False)
    # The 2-bit K/V of skipping token 2 is what token 3 reads: writing it at 16 bits changes token 3.
    wider = bits.clone()
    wider[0, 2] = 3
    assert (run(h, wq, wk, wv, wo, modes, wider, False)[0][0, 3] - base[0, 3]).abs().max() > 1e-4
    # Local token 7 (w = 3) reads keys 4..7: changing key 3 leaves it, changing key 4 does not.
    for key, moves in ((3, False), (4, True)):
        h2 = h.clone()
        h2[0, key] += 1.0
        out = run(h2, wq, wk, wv, wo, modes, bits, False)[0]
        assert bool((out[0, 7] - base[0, 7]).abs().max() > 1e-4) == moves, key


def designed_routes(Bn, Tn, E, g: torch.Generator) -> torch.Tensor:
    """(Bn, Tn, 2) expert ids (-1 = null), drawn from `g`: tokens with {null, j}, {j, j'} and {null, null}."""
    first = torch.randint(0, E, (Bn, Tn), generator=g)
    second = (first + 1 + torch.randint(0, E - 1, (Bn, Tn), generator=g)) % E
    index = torch.stack([first, second], -1)
    t = torch.arange(Tn).view(1, Tn).expand(Bn, Tn)
    index[..., 0][t % 3 == 0] = -1
    index[..., 1][t % 7 == 6] = -1
    index[..., 0][t % 7 == 6] = -1
    return index


def test_cost_audit_equals_hard_cost_and_bytes_at_rest_equal_kv_bits():
    model = tiny_model()
    cfg = model.config
    L, E = cfg.model.n_layers, cfg.router.num_experts
    modes, bits = designed()
    index = designed_routes(B, T, E, torch.Generator().manual_seed(5))
    assert bool((index < 0).all(-1).any())  # some tokens run no expert at all

    def decide(x, side, prev, positions, prices):  # the designed decisions, at each token's position
        b = torch.arange(x.shape[0]).view(-1, 1)
        m, o, i = modes[b, positions.clamp(max=T - 1)], bits[b, positions.clamp(max=T - 1)], index[b, positions.clamp(max=T - 1)]
        y = F.one_hot(m, 3).float()
        yb = F.one_hot(o, 4).float()
        w = torch.full(i.shape, 0.5)
        routes = ExpertRoutes(torch.zeros(*i.shape[:2], E + 1), i, w, torch.where(i >= 0, i + 1, 0))
        return RouterOutput(AxisDecision(y, y, m), AxisDecision(yb, yb, o), routes)

    for layer in model.layers:
        layer.decide = decide
    engine = InferenceEngine(model, page_size=4)
    prompts = torch.randint(0, cfg.model.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    # Prompts of T - 2 tokens, then 2 generated tokens fed back: T positions per request in all.
    ids = [engine.add(p[: T - 2].tolist(), max_new_tokens=4) for p in prompts]
    while engine.running:
        engine.step()
        if all(len(engine.requests[i].generated) == 3 for i in ids):
            break  # T tokens consumed: stop before anything is freed
    cost = hard_cost(modes, index, bits, torch.arange(T), cfg.model, cfg.router)
    audit = engine.audit
    assert audit.tokens == B * T
    assert abs(audit.budgeted_macs - L * float(cost.flops.sum())) <= 0.01 * L * float(cost.flops.sum())
    assert audit.budgeted_macs == L * float(cost.flops.sum())  # in fact exact
    assert audit.total("bytes_written") * 8 == L * float(cost.kv_bits.sum())
    assert engine.cache.memory()["used"] * 8 == L * float(cost.kv_bits.sum())


@pytest.mark.parametrize("d", [8, 32, 64, 128])
def test_rope_cache_equals_the_tables_bit_for_bit(d):
    """`RopeCache` (what a step's preparation looks up) against `rope_tables` computed for the step's
    own positions, for decode batches and prefill chunks, across the cache's growth (positions past
    its size grow it; the rows already looked up keep their values)."""
    from megatron_triroute.inference.attention import RopeCache, rope_tables

    g = torch.Generator().manual_seed(d)
    cache = RopeCache(d)
    for top in (5, 300, 257, 4_000, 70_000):
        for rows in (1, 3, 8, 64):
            positions = torch.randint(0, top + 1, (rows,), generator=g)
            positions[0] = top
            cos, sin = cache(positions, top)
            want_cos, want_sin = rope_tables(positions, d)
            assert cos.shape == want_cos.shape == (rows, 1, d)
            assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), (top, rows)
    assert cache.cos.shape[0] > 70_000
