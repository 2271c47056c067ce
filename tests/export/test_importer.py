"""`--import`: an exported directory back to a training checkpoint, bit-exact."""

import json

import pytest
import torch

@pytest.mark.distributed  # the checkpoints fixture spawns two gloo ranks
@pytest.mark.parametrize("name", ["ep2", "dense_tp2"])
def test_round_trip_is_bit_exact(checkpoints, exports, tmp_path, name):
    from megatron_triroute.checkpoint.sharded import GLOBAL_FORMAT, full_model_state
    from megatron_triroute.checkpoint.store import latest_valid_checkpoint, load_checkpoint
    from megatron_triroute.export.__main__ import main
    from megatron_triroute.inference.checkpoint import IGNORED, load_inference_checkpoint

    assert main(["--import", str(exports[name]), "--output", str(tmp_path / "ckpt")]) == 0
    step, _, meta = load_checkpoint(tmp_path / "ckpt")
    original_step, _, original_meta = load_checkpoint(checkpoints[name])
    assert step == original_step and meta["config"] == original_meta["config"]
    assert meta["checkpoint_format"] == GLOBAL_FORMAT and meta["weights_only"]
    original = full_model_state(latest_valid_checkpoint(checkpoints[name]).path / "sharded")
    imported = full_model_state(latest_valid_checkpoint(tmp_path / "ckpt").path / "sharded")
    original = {k: v for k, v in original.items() if k not in IGNORED}
    assert sorted(k for k in imported if k not in IGNORED) == sorted(original)
    for key, value in original.items():
        assert imported[key].dtype == value.dtype and torch.equal(imported[key], value), key
    # And the engine reads the imported checkpoint as it read the original.
    _, a = load_inference_checkpoint(checkpoints[name])
    _, b = load_inference_checkpoint(tmp_path / "ckpt")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_import_refuses_a_foreign_directory(tmp_path):
    from megatron_triroute.export.completeness import ExportError
    from megatron_triroute.export.importer import import_hf

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ExportError, match="not written by megatron_triroute.export"):
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _hand_made_export(directory, triroute, recorded):
    """A config.json as the exporter writes it, with `triroute` and `training_config.triroute` given."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "triroute", "triroute": triroute,
                                                       "training_config": {"triroute": recorded}}))


def test_import_refuses_config_halves_that_disagree(tmp_path):
    from megatron_triroute.config import TriRouteConfig
    from megatron_triroute.export.completeness import ExportError
    from megatron_triroute.export.importer import import_hf

    cfg = TriRouteConfig().validate().to_dict()
    edited = json.loads(json.dumps(cfg))
    edited["model"]["d_model"], edited["router"]["top_k"] = 128, 1
    _hand_made_export(tmp_path / "hf", edited, cfg)
    with pytest.raises(ExportError, match=r"(?s)disagree on 2 key\(s\):\n  model.d_model: triroute 128, "
                                          r"training_config.triroute 64\n  router.top_k: triroute 1, .* 2.*Fix"):
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_of_a_truncated_export_exits_2_naming_the_file(tmp_path, capsys):
    from safetensors.torch import save_file

    from megatron_triroute.config import TriRouteConfig
    from megatron_triroute.export.__main__ import main

    cfg = TriRouteConfig().validate().to_dict()
    _hand_made_export(tmp_path / "hf", cfg, cfg)
    weights = tmp_path / "hf" / "model.safetensors"
    save_file({"model.embed.weight": torch.ones(256, 64)}, str(weights))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["--import", str(tmp_path / "hf"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {weights} cannot be read") and "Traceback" not in err
    assert not (tmp_path / "out").exists()
