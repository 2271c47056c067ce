"""REINFORCE in the Megatron model: the reward slots deliver each token's LM loss to every layer's
attention and bit decisions, giving exactly the score-function gradient sum_t w_t (l_t - b) grad log pi."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute


def _worker(rank, world_size):
    import megatron_triroute.model.gpt as gpt

    cfg = tiny_triroute(estimator="reinforce")
    model, _ = build(cfg, seed=4)
    model.train()
    model.routing_step.set_step(0, 1.0)
    tokens, labels, idx = batch(cfg, n=2, seed=5)
    heads = [layer.controller.heads for layer in model.decoder.layers]
    params = [h[a].proj.weight for h in heads for a in ("attn", "bits")]

    def grads(with_reward: bool):
        outs = []
        hooks = [l.controller.register_forward_hook(lambda m, a, o: outs.append(o)) for l in model.decoder.layers]
        original = gpt.reward_slots_loss
        if not with_reward:
            gpt.reward_slots_loss = lambda loss, slots: loss
        try:
            model.zero_grad()
            loss = model(tokens, idx, labels=labels)
            loss.mean().backward()
        finally:
            gpt.reward_slots_loss = original
            for h in hooks:
                h.remove()
        return [p.grad.clone() for p in params], loss.detach(), outs

    with_r, token_loss, _ = grads(True)
    without, _, _ = grads(False)
    # A third forward (same noise key, same decisions) for the hand-written surrogate. Its aux
    # losses are zeroed: Megatron's aux-loss scaler would otherwise inject them into any backward
    # that passes through a layer's output, including this autograd.grad.
    from megatron_triroute.model.layer import TriRouteTransformerLayer

    outs = []
    hooks = [l.controller.register_forward_hook(lambda m, a, o: outs.append(o)) for l in model.decoder.layers]
    aux = TriRouteTransformerLayer.routing_loss
    TriRouteTransformerLayer.routing_loss = lambda self, outs, pos, costs: torch.zeros(())
    try:
        model(tokens, idx, labels=labels)
    finally:
        TriRouteTransformerLayer.routing_loss = aux
        for h in hooks:
            h.remove()
    # The hand-written surrogate: w_t = 1 / N (the mean), baseline 0 before its first update.
    w = torch.full_like(token_loss, 1.0 / token_loss.numel())
    surrogate = sum(((w * token_loss) * (o.attn.log_prob.sum(-1) + o.bits.log_prob)).sum() for o in outs)
    expected = torch.autograd.grad(surrogate, params)
    for a, b, e in zip(with_r, without, expected):
        assert e.abs().sum() > 0
        assert torch.allclose(a - b, e, atol=1e-6), (a - b - e).abs().max()
    assert all(layer.reward_baseline.pending()[1] > 0 for layer in model.decoder.layers)  # baseline observed


@pytest.mark.distributed
def test_reinforce_gradient_reaches_every_layer_through_the_reward_slots():
    run_distributed(_worker, 1)
