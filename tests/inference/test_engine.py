"""Batched serving: a batch of requests of different lengths (joining at different steps) gives
each request what it gets alone; sampling is seeded per request; freed pages are reused."""

import torch

from megatron_triroute.config import TriRouteConfig
from megatron_triroute.inference.engine import InferenceEngine, SamplingConfig, sample
from megatron_triroute.inference.model import InferenceModel


def tiny_model(seed=0, **router):
    cfg = TriRouteConfig()
    m, r = cfg.model, cfg.router
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size, m.seq_len = 32, 2, 4, 2, 64, 64, 32
    r.d_router, r.num_experts, r.window, r.kv_group_size = 16, 4, 3, 8
    for k, v in router.items():
        setattr(r, k, v)
    cfg.validate()
    torch.manual_seed(seed)
    model = InferenceModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            p.normal_(0, 0.3 if ".controller." in name else 0.1)
    return model


PROMPTS = [[3, 9, 4], [1, 2, 3, 4, 5, 6, 7], [8, 8, 9, 10, 11]]


def test_batch_of_different_lengths_equals_each_alone():
    model = tiny_model()
    alone = [InferenceEngine(model, record_logits=True).run([p], 5)[0] for p in PROMPTS]
    engine = InferenceEngine(model, record_logits=True, page_size=4)
    first = engine.add(PROMPTS[0], 5)
    engine.step()  # the first request is decoding when the others join
    later = [engine.add(p, 5) for p in PROMPTS[1:]]
    while engine.running:
        engine.step()
    together = [engine.requests[i] for i in [first] + later]
    for a, b in zip(alone, together):
        assert a.generated == b.generated
        assert torch.allclose(torch.stack(a.logits), torch.stack(b.logits), atol=1e-5, rtol=0)
    assert len({tuple(r.generated) for r in together}) > 1  # the prompts led to different texts


def test_sampling_is_seeded_and_top_p_keeps_the_nucleus():
    model = tiny_model()
    runs = [InferenceEngine(model, SamplingConfig(temperature=1.5, top_p=0.9, seed=s)).run(PROMPTS, 6)
            for s in (1, 1, 2)]
    assert [r.generated for r in runs[0]] == [r.generated for r in runs[1]]
    assert [r.generated for r in runs[0]] != [r.generated for r in runs[2]]
    logits = torch.tensor([3.0, 2.0, 0.0, -1.0])  # probabilities ~ 0.70, 0.26, 0.03, 0.01
    g = torch.Generator().manual_seed(0)
    drawn = {sample(logits, SamplingConfig(temperature=1.0, top_p=0.9), g) for _ in range(200)}
    assert drawn == {0, 1}
    assert sample(logits, SamplingConfig()) == 0


def test_finished_requests_free_their_pages_for_reuse():
    model = tiny_model()
    engine = InferenceEngine(model, page_size=2)
    engine.run(PROMPTS, 4)
    sizes = [[p.num_pages for p in layer.pools] for layer in engine.cache.layers]
    for layer in engine.cache.layers:
        for pool in layer.pools:
            assert sorted(pool.free) == list(range(pool.num_pages))  # every page back
    assert engine.cache.memory() == {"used": 0, "slack": 0, "index": 0}
    engine.run(PROMPTS, 4)  # same work again: served from the freed pages, no growth
    assert [[p.num_pages for p in layer.pools] for layer in engine.cache.layers] == sizes
