"""Checkpoints written before the routing state became typed named the final norm
`decoder.final_layernorm.norm.weight`; they still load, and read back under today's name."""

from dataclasses import replace

import torch

from megatron_triroute.checkpoint import sharded
from megatron_triroute.checkpoint.sharded import EARLIER_NAMES, full_model_state, load_model, save_model
from megatron_triroute.distributed.one_process import build_model, single_process_parallel
from tests.model.harness import tiny_triroute


def _save_described_as(directory, model, monkeypatch, rewrite):
    """save_model with the model's sharded description passed through `rewrite` (dict -> dict): what
    an earlier writer described."""
    describe = sharded.model_sharded_state_dict
    monkeypatch.setattr(sharded, "model_sharded_state_dict", lambda m: rewrite(describe(m)))
    save_model(directory, model)
    monkeypatch.setattr(sharded, "model_sharded_state_dict", describe)


def _save_under_earlier_names(directory, model, monkeypatch):
    def earlier(described):
        out = {}
        for key, value in described.items():
            name = EARLIER_NAMES.get(key[len("model."):])
            out[key] = replace(value, key=f"model.{name}") if name else value
        return out

    _save_described_as(directory, model, monkeypatch, earlier)


def test_final_norm_under_its_earlier_name_loads(tmp_path, monkeypatch):
    cfg = tiny_triroute()
    with single_process_parallel() as groups:
        model = build_model(cfg, groups, seed=1)
        with torch.no_grad():
            model.decoder.final_layernorm.weight.uniform_(0.5, 1.5)  # not the initial ones
        _save_under_earlier_names(tmp_path / "ckpt", model, monkeypatch)
        stored = sharded.read_metadata(tmp_path / "ckpt").state_dict_metadata
        assert "model.decoder.final_layernorm.norm.weight" in stored
        assert "model.decoder.final_layernorm.weight" not in stored
        fresh = build_model(cfg, groups, seed=2)
        load_model(tmp_path / "ckpt", fresh)
        for key, value in model.state_dict().items():
            if torch.is_tensor(value):
                assert torch.equal(fresh.state_dict()[key], value), key
    full = full_model_state(tmp_path / "ckpt")
    assert torch.equal(full["decoder.final_layernorm.weight"], model.decoder.final_layernorm.weight.detach())
    assert "decoder.final_layernorm.norm.weight" not in full


def _save_with_one_tensor_per_expert(directory, model, monkeypatch):
    """What the writer did while each expert was its own module: every expert's weight one
    ShardedTensor of the same global [layers, experts, out, in] tensor, at its global id."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def per_expert(described):
        out = {}
        for key, st in described.items():
            if ".moe.experts.w" not in key:
                out[key] = st
                continue
            assert st.prepend_axis_num == 1 and st.global_shape[1] == st.data.shape[0], (key, st)
            layer, first = st.global_offset[:2]
            for i, weight in enumerate(st.data.unbind(0)):
                out[f"{key}.{i}"] = ShardedTensor.from_rank_offsets(
                    st.key, weight, (0, layer, st.global_shape[0]), (1, first + i, st.global_shape[1]),
                    replica_id=st.replica_id, prepend_axis_num=2)
        return out

    _save_described_as(directory, model, monkeypatch, per_expert)


def test_experts_written_one_tensor_per_expert_load_into_the_stacked_weights(tmp_path, monkeypatch):
    cfg = tiny_triroute()
    with single_process_parallel() as groups:
        model = build_model(cfg, groups, seed=1)
        _save_with_one_tensor_per_expert(tmp_path / "ckpt", model, monkeypatch)
        stored = sharded.read_metadata(tmp_path / "ckpt").state_dict_metadata
        key = "model.decoder.layers.mlp.experts.moe.experts.w1.weight"
        assert len(stored[key].chunks) == cfg.model.n_layers * cfg.router.num_experts  # one chunk per expert
        fresh = build_model(cfg, groups, seed=2)
        assert not torch.equal(fresh.state_dict()[key[len("model."):].replace("layers.", "layers.0.")],
                               model.state_dict()[key[len("model."):].replace("layers.", "layers.0.")])
        load_model(tmp_path / "ckpt", fresh)
        for name, value in model.state_dict().items():
            if torch.is_tensor(value):
                assert torch.equal(fresh.state_dict()[name], value), name
