"""Activation recomputation changes nothing; bf16 training keeps the router in fp32."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute


def _step(cfg, recompute=False, bf16=False):
    from megatron_triroute.parallel import destroy_parallel
    from megatron_triroute.training.engine import MicroBatch, TrainEngine

    model, groups = build(cfg, seed=2, recompute=recompute)
    engine = TrainEngine(model, groups, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=10, bf16=bf16)
    seen = {}
    layer = model.decoder.layers[0]
    hooks = [layer.self_attention.linear_qkv.register_forward_hook(lambda m, a, o: seen.__setitem__("qkv", o[0].dtype)),
             layer.controller.register_forward_hook(lambda m, a, o: seen.__setitem__("router", o.attn.logits.dtype))]
    tokens, labels, idx = batch(cfg, n=2, seed=1)
    mb = MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)
    report = engine.train_step([mb, mb], 0)
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    whiten = [b.clone() for n, b in model.named_buffers() if "whiten" in n]
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    for h in hooks:
        h.remove()
    destroy_parallel()
    return report, grads, whiten, dtypes, seen


def _worker(rank, world_size):
    cfg = tiny_triroute()
    plain, g0, w0, _, _ = _step(cfg)
    again, g1, w1, _, _ = _step(cfg, recompute=True)
    assert plain.loss == again.loss and plain.lambdas == again.lambdas
    for name in g0:
        assert torch.allclose(g0[name], g1[name], atol=1e-6), name
    for a, b in zip(w0, w1):  # statistics accumulated once, not again in the recompute
        assert torch.equal(a, b)
    low, gb, _, dtypes, seen = _step(cfg, bf16=True)
    assert abs(low.loss - plain.loss) < 0.05 and all(torch.isfinite(g).all() for g in gb.values())
    assert low.loss != plain.loss  # the matmuls really ran in bf16
    assert seen == {"qkv": torch.bfloat16, "router": torch.float32}, seen
    assert all(d == torch.float32 for d in dtypes.values())  # fp32 master parameters


@pytest.mark.distributed
def test_recompute_is_exact_and_bf16_keeps_router_fp32():
    run_distributed(_worker, 1, timeout=240)
