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


def test_compiled_quantisation_equals_eager_with_one_graph_for_every_layer(monkeypatch):
    """The relaxed write's quantisation (every width of every token) compiled gives the eager
    values bit for bit; K/V of one shape at any layer reuse one graph."""
    from megatron_triroute.routing.quant import quantized_values, relaxed_kv_write

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(compiled, "COMPILE_BACKENDS", compiled.COMPILE_BACKENDS + (counter,))
    compiled.routing_ops.cache_clear()
    ops = compiled.routing_ops(counter)
    g = torch.Generator().manual_seed(3)
    for layer in range(3):
        x = torch.randn(2, 5, 4, 16, generator=g) * (1 + layer)
        x[0, 0, 0, :8] = 0.25  # a constant group: scale 0
        for bits in ((2, 4, 8, 16), (4,)):
            assert torch.equal(ops.quantize(x, bits, 8), quantized_values(x, bits, 8))
        y = torch.nn.functional.one_hot(torch.randint(0, 4, (2, 5), generator=g), 4).float()
        assert torch.equal(relaxed_kv_write(x, y, (2, 4, 8, 16), 8, ops.quantize),
                           relaxed_kv_write(x, y, (2, 4, 8, 16), 8))
        if layer == 0:
            first = counter.frame_count
    assert counter.frame_count == first > 0  # graphs per width set, none per layer
    compiled.routing_ops.cache_clear()


def test_auto_compiles_nothing_for_a_model_on_a_cpu():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled.routing_ops.cache_clear()
    ops = compiled.routing_ops("auto")
    assert ops.compiled  # the temperature reaches it as a tensor, as a compiled op wants
    x = torch.randn(2, 3, 2, 8)
    from megatron_triroute.routing.quant import quantized_values

    assert torch.equal(ops.quantize(x, (2, 16), 8), quantized_values(x, (2, 16), 8))
    z = torch.randn(2, 3, 4)
    y, y_cost = ops.relax(z, z, torch.zeros_like(z), torch.tensor(1.5))
    assert torch.equal(y, y_cost) and torch.equal(y.sum(-1), torch.ones(2, 3))
    assert torch._dynamo.utils.counters["frames"]["total"] == 0  # nothing traced, nothing compiled
    compiled.routing_ops.cache_clear()
