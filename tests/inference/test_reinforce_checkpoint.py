"""A REINFORCE-trained model serves: its reward baseline is a training-only buffer the engine's map
leaves out, while every other tensor is still required."""

import pytest
import torch


def test_reward_baseline_is_training_only():
    from megatron_triroute.config import TriRouteConfig
    from megatron_triroute.inference.checkpoint import InferenceCheckpointError, map_megatron_state
    from megatron_triroute.distributed.one_process import build_model, single_process_parallel
    from megatron_triroute.systems import system_config

    cfg = TriRouteConfig()
    m, r = cfg.model, cfg.router
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size, m.seq_len = 32, 2, 4, 2, 64, 64, 16
    r.d_router, r.num_experts, r.window, r.kv_group_size = 16, 4, 3, 8
    cfg = system_config("reinforce", cfg.validate()).validate()
    with single_process_parallel() as groups:
        state = {k: v for k, v in build_model(cfg, groups).state_dict().items() if torch.is_tensor(v)}
    assert any(".reward_baseline." in k for k in state)
    mapped = map_megatron_state(state, cfg)
    assert not any("reward_baseline" in k for k in mapped)
    state.pop("decoder.layers.1.self_attention.linear_proj.weight")
    with pytest.raises(InferenceCheckpointError, match="missing decoder.layers.1.self_attention.linear_proj.weight"):
        map_megatron_state(state, cfg)
