"""Reading an export's weights: shard names stay inside the directory, and a damaged file is
refused by name."""

import json

import pytest
import torch
from safetensors.torch import save_file


def _shards(directory, names):
    """An index whose one tensor lives in the shard file `names` (as written into the index)."""
    directory.mkdir()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))


@pytest.mark.parametrize("where", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors"])
def test_index_entries_outside_the_directory_are_refused(tmp_path, where):
    from megatron_triroute.export.completeness import ExportError
    from megatron_triroute.export.safetensors_io import read_weights

    outside = tmp_path / "outside.safetensors"  # a readable file: read, it would be returned as weights
    save_file({"w": torch.ones(2)}, str(outside))
    name = str(outside) if where == "ABSOLUTE" else where
    _shards(tmp_path / "hf", {"w": name})
    with pytest.raises(ExportError, match=rf"weight_map names the shard '{name}', which is not a file name inside"):
        read_weights(tmp_path / "hf")


def test_a_truncated_weights_file_is_refused_naming_it(tmp_path):
    from megatron_triroute.export.completeness import ExportError
    from megatron_triroute.export.safetensors_io import read_weights, write_weights

    (tmp_path / "hf").mkdir()
    tensors = {f"w{i}": torch.full((64,), float(i)) for i in range(4)}
    files = write_weights(tmp_path / "hf", tensors, max_shard_bytes=300)  # several shards and an index
    assert len(files) > 1 and torch.equal(read_weights(tmp_path / "hf")["w3"], tensors["w3"])
    shard = tmp_path / "hf" / files[-1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ExportError, match=rf"{shard} cannot be read .*truncated, corrupted or missing. Fix: copy"):
        read_weights(tmp_path / "hf")
