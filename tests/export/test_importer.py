"""`--import`: an exported directory back to a training checkpoint, bit-exact."""

import pytest
import torch

pytestmark = pytest.mark.distributed  # the checkpoints fixture spawns two gloo ranks


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
