"""Checkpoints written before the routing state became typed named the final norm
`decoder.final_layernorm.norm.weight`; they still load, and read back under today's name."""

from dataclasses import replace

import torch

from megatron_triroute.checkpoint import sharded
from megatron_triroute.checkpoint.sharded import EARLIER_NAMES, full_model_state, load_model, save_model
from tests.model.harness import tiny_triroute


def _save_under_earlier_names(directory, model, monkeypatch):
    describe = sharded.model_sharded_state_dict

    def earlier(m):
        out = {}
        for key, value in describe(m).items():
            name = EARLIER_NAMES.get(key[len("model."):])
            out[key] = replace(value, key=f"model.{name}") if name else value
        return out

    monkeypatch.setattr(sharded, "model_sharded_state_dict", earlier)
    save_model(directory, model)
    monkeypatch.setattr(sharded, "model_sharded_state_dict", describe)


def test_final_norm_under_its_earlier_name_loads(tmp_path, monkeypatch):
    from megatron_triroute.distributed.one_process import build_model, single_process_parallel

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
