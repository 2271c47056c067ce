"""`router.compile`: the compiled routing ops give the eager controller's decisions and gradients,
and one graph serves every step and layer (the step and layer reach it as tensors)."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from megatron_triroute import TriRouteController
from megatron_triroute.config import ConfigError
from megatron_triroute.routing import compiled
from megatron_triroute.routing.noise import NoiseKey

from .helpers import make_inputs, tiny_config


def _step(controller, hidden, side, step, layer):
    h = hidden.clone().requires_grad_(True)
    key = NoiseKey(11, step, layer, torch.arange(2), torch.arange(hidden.shape[1]))
    out = controller(h, side, key, tau=1.7 - 0.1 * step)
    loss = (out.attn.y * torch.arange(3.0)).sum() + (out.bits.y * torch.arange(4.0)).sum() * 2 + out.attn.y_cost.sum()
    loss.backward()
    grads = [h.grad] + [p.grad.clone() for p in controller.parameters() if p.grad is not None]
    assert len(grads) > 10  # the trunk's and both categorical heads' parameters
    controller.zero_grad(set_to_none=True)
    return out, grads


def test_compiled_routing_ops_equal_eager_with_one_graph_for_all_steps_and_layers(monkeypatch):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")  # traces forward and backward; no code generation
    monkeypatch.setattr(compiled, "COMPILE_BACKENDS", compiled.COMPILE_BACKENDS + (counter,))
    compiled.routing_ops.cache_clear()
    torch.manual_seed(0)
    cfg = tiny_config()
    eager = TriRouteController(cfg, 0).train()
    fast = TriRouteController(cfg, 0).train()
    fast.load_state_dict(eager.state_dict())
    fast.ops = compiled.routing_ops(counter)
    hidden, side = make_inputs(cfg)
    for step, layer in ((0, 0), (1, 0), (1, 1), (5, 3)):
        a, grads_a = _step(eager, hidden, side, step, layer)
        b, grads_b = _step(fast, hidden, side, step, layer)
        for axis in ("attn", "bits"):
            assert torch.equal(getattr(a, axis).y, getattr(b, axis).y)
            assert torch.equal(getattr(a, axis).y_cost, getattr(b, axis).y_cost)
        for ga, gb in zip(grads_a, grads_b):
            assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-6)
    # One graph for the noise, one for the relaxation (attn and bits shapes): no recompiles per step/layer.
    assert counter.frame_count == 3, counter.frame_count
    compiled.routing_ops.cache_clear()


def test_compile_switch_names_the_backends():
    assert compiled.routing_ops(None) is compiled.EAGER
    with pytest.raises(ValueError, match="router.compile='cudagraphs'.*Fix"):
        compiled.routing_ops("cudagraphs")
    with pytest.raises(ConfigError, match="router.compile"):
        tiny_config(compile="fast")
