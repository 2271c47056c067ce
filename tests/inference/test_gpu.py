"""The engine on a CUDA device against the same engine on the CPU (skipped on CPU machines).

The same tiny model (CPU initialisation) serves the same batch of different-length requests on
both devices: on CUDA the cache pages, the kernels (Triton where installed) and every tensor the
engine creates live on the GPU. fp32 without TF32, so the two agree to rounding: identical tokens
and decisions, logits within 1e-4, identical audit counters and bytes at rest."""

import contextlib
import copy

import pytest
import torch

from megatron_triroute.inference.engine import InferenceEngine
from tests.inference.test_engine import PROMPTS, tiny_model

pytestmark = pytest.mark.gpu


def _serve(model):
    engine = InferenceEngine(model, record_logits=True, page_size=4)
    first = engine.add(PROMPTS[0], 6)
    engine.step()  # the first request decodes while the others prefill
    rest = [engine.add(p, 6) for p in PROMPTS[1:]]
    mem = None
    while engine.running:
        engine.step()
        if mem is None:
            mem = engine.cache.memory()
    return [engine.requests[i] for i in [first] + rest], engine, mem


def test_engine_on_cuda_equals_cpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model()
    cpu, cpu_engine, cpu_mem = _serve(model)
    gpu, gpu_engine, gpu_mem = _serve(copy.deepcopy(model).to("cuda"))
    for layer in gpu_engine.cache.layers:
        for pool in layer.pools:
            assert pool.token_pos.is_cuda and all(t.is_cuda for t in pool.k.storage_tensors() + pool.v.storage_tensors())
    for a, b in zip(cpu, gpu):
        assert a.generated == b.generated
        for x, y in zip(a.logits, b.logits):
            assert (x - y.cpu()).abs().max() < 1e-4
    assert cpu_engine.audit.summary() == gpu_engine.audit.summary()
    assert cpu_mem == gpu_mem


@contextlib.contextmanager
def _no_sync():
    """CUDA's sync check set to raise for the block."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_decode_step_on_cuda_waits_for_nothing():
    """The device step of a decode (`forward_step`: the Triton attention and append, the static
    experts) under CUDA's sync check set to raise, after the host prepares it; logits as the CPU's."""
    from tests.inference.test_decode_step import decode_steps

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model()
    cpu = [logits for logits, _ in decode_steps(model, 3)]
    gpu = [logits.cpu() for logits, _ in decode_steps(copy.deepcopy(model).to("cuda"), 3, _no_sync)]
    torch.testing.assert_close(torch.stack(gpu), torch.stack(cpu), rtol=1e-4, atol=1e-4)
