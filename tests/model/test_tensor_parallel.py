"""TP=2 vs TP=1 for the whole TriRoute GPT: same decisions, logits and gradients."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, decision_margin, tiny_triroute


def _capture(model):
    outs = []
    hooks = [layer.controller.register_forward_hook(lambda m, a, out: outs.append(out)) for layer in model.decoder.layers]
    return outs, hooks


def _run(cfg, tp):
    from megatron.core import parallel_state

    from megatron_triroute.parallel import destroy_parallel, reduce_gradients

    model, groups = build(cfg, tp=tp)
    tokens, labels, idx = batch(cfg, n=2, seed=3)
    outs, hooks = _capture(model)
    model.train()
    model.routing_step.set_step(0, 1.0)
    loss = model(tokens, idx, labels=labels)
    loss.mean().backward()
    reduce_gradients(model, groups)
    logits = model(tokens, idx)  # (B, T, V / tp), same noise key -> same decisions
    for h in hooks:
        h.remove()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    full_logits = _gather(logits.detach(), -1, tp, tp_group)
    grads, replicated_equal = {}, True
    for name, p in model.named_parameters():
        g = p.grad.detach()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            g = _gather(g, p.partition_dim, tp, tp_group)
        elif tp > 1:
            peers = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(peers, g.contiguous(), group=tp_group)
            replicated_equal &= all(torch.equal(peers[0], x) for x in peers)
        grads[name] = g
    decisions = [(o.attn.y.detach(), o.bits.y.detach(), o.experts.index, o.experts.weight.detach(),
                  o.attn.logits.detach(), o.bits.logits.detach(), o.experts.probs.detach()) for o in outs[: cfg.model.n_layers]]
    destroy_parallel()
    return loss.detach(), full_logits, grads, decisions, replicated_equal


def _gather(t, dim, tp, group):
    if tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _worker(rank, world_size):
    cfg = tiny_triroute()
    loss2, logits2, grads2, dec2, replicated_equal = _run(cfg, tp=2)
    loss1, logits1, grads1, dec1, _ = _run(cfg, tp=1)
    _, _, idx = batch(cfg, n=2, seed=3)
    margin = decision_margin(cfg, dec1, idx)
    assert margin > 1e-4, f"near-tie decision ({margin}): pick another seed"
    for a, b in zip(dec1, dec2):
        for x, y in zip(a[:3], b[:3]):
            assert torch.equal(x, y)
    assert torch.allclose(loss1, loss2, atol=1e-5)
    assert torch.allclose(logits1, logits2, atol=1e-5)
    assert grads1.keys() == grads2.keys()
    for name in grads1:
        assert torch.allclose(grads1[name], grads2[name], atol=1e-5), (name, (grads1[name] - grads2[name]).abs().max())
    assert replicated_equal, "replicated parameters (controller, norms) got different gradients on the TP ranks"
    assert any("controller" in n and grads2[n].abs().sum() > 0 for n in grads2)


@pytest.mark.distributed
def test_tp2_matches_tp1_decisions_logits_gradients():
    run_distributed(_worker, 2, timeout=240)
