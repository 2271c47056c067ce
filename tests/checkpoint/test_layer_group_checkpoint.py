"""Layer-group attention: only each group's leader layer has an attention head, so its controller
tensors are saved under per-layer keys (a stack over all layers would have holes). A model saved
this way reads back whole, in one process and into a fresh model."""

import torch

from megatron_triroute.checkpoint.sharded import full_model_state, load_model, save_model


def _config():
    from megatron_triroute.config import TriRouteConfig
    from megatron_triroute.systems import system_config

    cfg = TriRouteConfig()
    m, r = cfg.model, cfg.router
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size, m.seq_len = 32, 4, 4, 2, 64, 64, 16
    r.d_router, r.num_experts, r.window, r.kv_group_size, r.layer_group_size = 16, 4, 3, 8, 2
    return system_config("layer_group_attention", cfg.validate()).validate()


def test_leader_only_controller_tensors_round_trip(tmp_path):
    from megatron_triroute.distributed.one_process import build_model, single_process_parallel

    cfg = _config()
    with single_process_parallel() as groups:
        model = build_model(cfg, groups, seed=1)
        state = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        leader = {k for k in state if k.startswith("decoder.layers.0.controller.") and ".attn." in k}
        assert leader and not any(k.replace(".0.", ".1.", 1) in state for k in leader)  # the follower has none
        save_model(tmp_path / "ckpt", model)
        fresh = build_model(cfg, groups, seed=2)
        assert any(not torch.equal(fresh.state_dict()[k], v) for k, v in state.items())
        load_model(tmp_path / "ckpt", fresh)
        for key, value in state.items():
            assert torch.equal(fresh.state_dict()[key], value), key
    full = full_model_state(tmp_path / "ckpt")
    for key, value in state.items():
        if not key.endswith("_extra_state"):
            assert torch.equal(full[key], value), key
