"""Files a save adds under `sharded/` (the trainer's global tensors) are committed, checksummed and
verified like the per-rank shards: damaging one makes the load fall back to the previous step."""

import json

import torch

from megatron_triroute.checkpoint import latest_valid_checkpoint, save_checkpoint
from megatron_triroute.checkpoint.store import EXTRA_DIR


def _writer(payload: bytes):
    def write(directory):
        (directory / "sub").mkdir(parents=True)
        (directory / "sub" / "part.bin").write_bytes(payload)
        (directory / ".metadata").write_bytes(payload[::-1])
        return [directory / "sub" / "part.bin", directory / ".metadata"]
    return write


def test_extra_files_are_in_the_manifest_and_verified(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"x": torch.ones(2) * step}, {"step": step},
                        write_extra=_writer(bytes([step]) * 100))
    final = tmp_path / "step_00000002"
    manifest = json.loads((final / "manifest.json").read_text())
    assert {f"{EXTRA_DIR}/sub/part.bin", f"{EXTRA_DIR}/.metadata"} <= set(manifest["files"])
    assert (final / EXTRA_DIR / "sub" / "part.bin").read_bytes() == bytes([2]) * 100
    assert latest_valid_checkpoint(tmp_path).step == 2

    part = final / EXTRA_DIR / "sub" / "part.bin"
    original = part.read_bytes()
    damaged = bytearray(original)
    damaged[50] ^= 0xFF
    part.write_bytes(bytes(damaged))
    assert latest_valid_checkpoint(tmp_path).step == 1
    part.write_bytes(original)
    assert latest_valid_checkpoint(tmp_path).step == 2
    (final / EXTRA_DIR / ".metadata").unlink()
    assert latest_valid_checkpoint(tmp_path).step == 1
