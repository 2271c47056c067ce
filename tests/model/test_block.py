"""The block computes its layers' routing losses and statistics once (every layer's axes in one
block, their decisions stacked): the same gradients, statistics and budget observations as each
layer doing its own."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute


def _grads(cfg, mode: str):
    from megatron_triroute.model import block
    from megatron_triroute.model.layer import TriRouteTransformerLayer
    from megatron_triroute.parallel import destroy_parallel
    from megatron_triroute.training.engine import MicroBatch, TrainEngine

    run, routing_loss, calls = block._run, TriRouteTransformerLayer.routing_loss, []

    def per_layer(layers, x, inputs, state, rotary_pos_emb):  # each layer attaches its own losses
        for layer in layers:
            x, state = layer(hidden_states=x, inputs=inputs, state=state, rotary_pos_emb=rotary_pos_emb)
        return x, state

    def counted(self, outs, *args):
        calls.append(len(outs))
        return routing_loss(self, outs, *args) if mode != "none" else torch.zeros(())

    block._run = per_layer if mode == "per_layer" else run
    TriRouteTransformerLayer.routing_loss = counted
    try:
        model, groups = build(cfg, seed=2)
        engine = TrainEngine(model, groups, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=10)
        tokens, labels, idx = batch(cfg, n=2, seed=1)
        report = engine.train_step([MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)], 0)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        grads["statistics"] = report.statistics.clone()
        grads["realised"], grads["lambdas"] = torch.tensor(report.realised), torch.tensor(report.lambdas)
    finally:
        block._run, TriRouteTransformerLayer.routing_loss = run, routing_loss
        destroy_parallel()
    return grads, calls


def _worker(rank, world_size, router):
    cfg = tiny_triroute(**router)
    together, calls = _grads(cfg, "together")
    assert calls == [cfg.model.n_layers], calls  # one call for every layer of the stage
    alone, calls = _grads(cfg, "per_layer")
    assert calls == [1] * cfg.model.n_layers, calls
    assert together.keys() == alone.keys()
    for name in together:
        torch.testing.assert_close(together[name], alone[name], rtol=1e-5, atol=1e-7, msg=name)
    stats = together["statistics"]
    assert stats.shape[0] == cfg.model.n_layers and (stats != 0).any(dim=1).all()  # every layer's row recorded
    assert (together["realised"] > 0).all()
    without, _ = _grads(cfg, "none")  # the check can fail: the losses move the controllers' gradients
    assert any(not torch.allclose(together[n], without[n], atol=1e-6) for n in together if "controller" in n)


@pytest.mark.distributed
@pytest.mark.parametrize("router", [{}, {"attn_granularity": "layer_group", "layer_group_size": 2}],
                         ids=["per_layer", "layer_group"])  # layer-group followers have no attention logits
def test_the_blocks_routing_losses_and_statistics_equal_each_layers_own(router):
    run_distributed(_worker, 1, router, timeout=240)
