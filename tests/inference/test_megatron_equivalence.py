"""The engine's logits equal the Megatron model's eval-mode forward (1e-4, fp32), with identical
(priced, noise-free) decisions, for TriRoute (zero and nonzero prices), each of the six systems and
the token-level and layer-group attention variants;
both as one prefill and decoded token by token. The weights go through the checkpoint name
mapping (`inference.checkpoint.map_megatron_state`); controller biases and whitening statistics
are perturbed so every attention mode, bit-width and expert (null included) occurs, and an EOD
token mid-sequence exercises the document-position reset."""

import pytest
import torch

from megatron_triroute.routing.modes import FULL
from tests.dist_utils import run_distributed
from tests.model.harness import build, tiny_triroute

SYSTEMS = ("triroute", "dense", "mod", "moe", "kvquant", "independent")


def _tables(V, eod):
    from megatron_triroute.routing.side_features import TokenTables

    g = torch.Generator().manual_seed(3)
    return TokenTables(torch.log_softmax(torch.randn(V, generator=g) * 2, 0), torch.rand(V, generator=g) < 0.4, eod)


def _perturb(model, seed):
    """Spread the controller's decisions over every option (random head biases, whitening stats)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if ".controller." in name and name.endswith("bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif ".controller." in name and name.endswith("proj.weight"):
                t.mul_(40.0)  # token-dependent logits, not a per-layer constant
        for name, t in model.named_buffers():
            if name.endswith("whiten.mean"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.05)
            elif name.endswith("whiten.var"):
                t.copy_(torch.rand(t.shape, generator=g) * 0.5 + 0.5)


def _modes(attention, args) -> torch.Tensor:
    """The executed modes (B, T, H_local) of the attention's inputs; none given (attention not routed):
    every head reads everything."""
    if args[1] is None:
        T, B = args[0].shape[:2]
        return torch.full((B, T, attention.heads_local), FULL, dtype=torch.long)
    return args[1].argmax(-1)


def _megatron_forward(model, tokens, prices=None):
    """Logits and per-layer decisions (modes, bit option, expert index) of the eval-mode forward
    at `prices` (None: the plain argmax)."""
    seen = []
    hooks = []
    for layer in model.decoder.layers:
        rec = {}
        seen.append(rec)
        hooks.append(layer.self_attention.register_forward_pre_hook(
            lambda m, a, kw, rec=rec: rec.update(mode=_modes(m, a), bits=a[2].argmax(-1)), with_kwargs=True))
        if hasattr(layer.mlp, "experts"):
            hooks.append(layer.mlp.register_forward_pre_hook(lambda m, a, kw, rec=rec: rec.update(index=a[1]), with_kwargs=True))
    with torch.no_grad(), model.routing_step.evaluation(prices):
        logits = model(tokens, torch.arange(tokens.shape[0]))
    for h in hooks:
        h.remove()
    return logits, seen


def _engine(model, cfg, tables):
    from megatron_triroute.inference.checkpoint import load_state, map_megatron_state
    from megatron_triroute.inference.model import InferenceModel

    state = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    engine = InferenceModel(cfg, tables)
    load_state(engine, map_megatron_state(state, cfg))
    return engine


def _run_engine(engine, tokens, one_by_one):
    from megatron_triroute.inference.side_state import SideState

    B, T = tokens.shape
    cache, states, rids = engine.new_cache(page_size=4, initial_pages=1), [SideState() for _ in range(B)], list(range(B))
    for r in rids:
        cache.add_request(r)
    if not one_by_one:
        logits, outs = engine.step(tokens, torch.full((B,), T), states, cache, rids, all_logits=True)
        return logits, [outs]
    logits, steps = [], []
    for t in range(T):
        lg, outs = engine.step(tokens[:, t : t + 1], torch.ones(B, dtype=torch.long), states, cache, rids, all_logits=True)
        logits.append(lg)
        steps.append(outs)
    return torch.cat(logits, 1), steps


def _decisions(steps, layer, B, T):
    """Per-layer executed (mode, bits, expert index) of the engine, stacked over decode steps."""
    outs = [s[layer] for s in steps]
    mode = torch.cat([o.attn.y.argmax(-1) for o in outs], 1)
    bits = torch.cat([o.bits.y.argmax(-1) for o in outs], 1)
    index = None if outs[0].experts is None else torch.cat([o.experts.index for o in outs], 1)
    return mode, bits, index


def _checks(rank, world_size):
    from megatron_triroute.parallel import destroy_parallel
    from megatron_triroute.systems import system_config

    base = tiny_triroute()  # window 3, bits (2, 4, 8, 16), 4 experts top-2 with null, T = 12
    T, V = base.model.seq_len, base.model.vocab_size
    eod = 5
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(6, V, (2, T), generator=g)
    tokens[0, 4] = eod  # document boundary mid-sequence
    tables = _tables(V, eod)
    # (system, prices, perturbation seed): the two TriRoute seeds between them write at every width.
    cases = [(s, None, 11) for s in SYSTEMS] + [("triroute", (25.0, 3.0), 10)]
    # Two ablation variants whose attention decisions take other paths (one mode per token; a layer
    # group's leader deciding for its followers, priced).
    cases += [("token_attention", None, 11), ("layer_group_attention", (25.0, 3.0), 10)]
    coverage = {"mode": set(), "bits": set(), "null": False}
    for name, prices, seed in cases:
        cfg = system_config(name, base)
        model, _ = build(cfg, seed=21)
        from megatron_triroute.model.gpt import TriRouteGPTModel  # noqa: F401 (built above)

        model.token_log_prob.copy_(tables.log_prob)
        model.token_word_start.copy_(tables.word_start)
        model.eod_id = eod
        _perturb(model, seed)
        if prices is not None:  # the checkpoint's copy, which the engine serves
            model.budget.prices.copy_(torch.tensor(prices, dtype=torch.float64))
        want, seen = _megatron_forward(model, tokens, prices)
        engine = _engine(model, cfg, tables)
        for one_by_one in (False, True):
            got, steps = _run_engine(engine, tokens, one_by_one)
            where = f"{name} prices={prices} token-by-token={one_by_one}"
            for layer, rec in enumerate(seen):
                mode, bits, index = _decisions(steps, layer, 2, T)
                assert torch.equal(mode, rec["mode"]), where
                assert torch.equal(bits, rec["bits"]), where
                if index is not None:
                    assert torch.equal(index.transpose(0, 1).reshape(2 * T, -1), rec["index"]), where
                    coverage["null"] |= bool((index < 0).any())
                coverage["mode"] |= set(mode.unique().tolist())
                if name == "triroute":
                    coverage["bits"] |= {cfg.router.bits[o] for o in bits.unique().tolist()}
            err = (got - want).abs().max().item()
            assert err < 1e-4, (where, err)
        if prices is not None and name == "triroute":  # the prices changed some decision (else this case tests nothing new)
            _, unpriced = _megatron_forward(model, tokens)
            assert any(not torch.equal(a["mode"], b["mode"]) or not torch.equal(a["bits"], b["bits"])
                       for a, b in zip(seen, unpriced)), "prices changed no decision"
        destroy_parallel()
    assert coverage["mode"] == {0, 1, 2} and coverage["bits"] == {2, 4, 8, 16} and coverage["null"], coverage


@pytest.mark.distributed
def test_engine_logits_and_decisions_equal_megatron_eval_forward():
    run_distributed(_checks, 1, timeout=600)
