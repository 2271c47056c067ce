"""Transformer Engine in the layer spec: a clear error without it (CPU), a working model with it (GPU)."""

import pytest
import torch

from tests.model.harness import batch, tiny_triroute


def test_use_te_without_transformer_engine_raises_a_clear_import_error(monkeypatch):
    from megatron_triroute.model import spec

    monkeypatch.setattr(spec, "HAVE_TE", False)  # as on a machine without the package
    cfg = tiny_triroute()
    with pytest.raises(ImportError, match=r"use_te=True.*Transformer Engine.*install the 'gpu' extra"):
        spec.get_triroute_layer_spec(cfg, use_te=True)
    with pytest.raises(ImportError, match="Transformer Engine"):
        spec.get_triroute_block_spec(cfg, spec.transformer_config(cfg), use_te=True)
    assert spec.get_triroute_layer_spec(cfg, use_te=False).submodules.self_attention is not None


def _te_model(rank, world_size):
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm, TERowParallelLinear

    from megatron_triroute.model.gpt import TriRouteGPTModel
    from megatron_triroute.model.spec import get_triroute_layer_spec, transformer_config
    from megatron_triroute.parallel import initialize_parallel

    cfg = tiny_triroute()
    layer = get_triroute_layer_spec(cfg, use_te=True)
    sub = layer.submodules
    assert sub.input_layernorm is TENorm and sub.pre_mlp_layernorm is TENorm
    assert sub.self_attention.submodules.linear_qkv is TEColumnParallelLinear
    assert sub.self_attention.submodules.linear_proj is TERowParallelLinear

    torch.cuda.set_device(0)
    groups = initialize_parallel(1, 1, 1)
    torch.manual_seed(0)
    model = TriRouteGPTModel(transformer_config(cfg, use_cpu_initialization=False), cfg, groups=groups,
                             use_te=True).cuda()
    assert type(model.decoder.layers[0].self_attention.linear_qkv) is TEColumnParallelLinear
    tokens, labels, idx = (t.cuda() for t in batch(cfg))
    model.train()
    loss = model(tokens, idx, labels=labels)
    assert loss.shape == tokens.shape and torch.isfinite(loss).all()
    loss.mean().backward()
    assert all(p.grad is not None for p in model.decoder.layers[0].self_attention.parameters())


@pytest.mark.gpu
def test_te_spec_builds_and_trains_a_model_on_gpu():
    pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed (pip install '.[gpu]')")
    from tests.dist_utils import run_distributed

    run_distributed(_te_model, 1)
