"""Writing and reading Hugging Face safetensors weights: one file, or shards plus
`model.safetensors.index.json`; metadata `format: pt`. Tensors are made contiguous (and cast) one
shard at a time, so an export holds the model once plus at most one shard's copies."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..progress import Progress
from .completeness import ExportError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '2GiB' / '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ExportError(f"--max-shard-size {text!r}: expected a number of bytes or e.g. 5GB, 500MB, 2GiB")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(float(match.group(1)) * scale)
    if size <= 0:
        raise ExportError(f"--max-shard-size {text!r}: must be positive")
    return size


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with storage of its own (a view into a larger tensor is copied: one
    shard's worth at a time)."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def write_weights(directory: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int,
                  cast=lambda name, t: t) -> list[str]:
    """Write `tensors` (cast by `cast(name, tensor)`) into `directory`; returns the file names."""
    from safetensors.torch import save_file

    names = list(tensors)
    sizes = {n: tensors[n].numel() * cast(n, tensors[n][:0] if tensors[n].dim() else tensors[n]).element_size()
             for n in names}
    shards: list[list[str]] = [[]]
    used = 0
    for n in names:
        if shards[-1] and used + sizes[n] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(n)
        used += sizes[n]
    files = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
    weight_map = {}
    progress = Progress(sum(sizes.values()) / 1e6, "MB", "export", interval=0)
    for i, (file, shard) in enumerate(zip(files, shards)):
        save_file({n: _own(cast(n, tensors[n])) for n in shard}, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        progress.update(sum(sizes[n] for n in shard) / 1e6, f"wrote {file} ({i + 1}/{len(files)} files, "
                        f"{len(shard)} tensors)")
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files


def read_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, or an ExportError naming it when it cannot be read
    (truncated, corrupted, missing)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise ExportError(f"{path} cannot be read ({error}): the file is truncated, corrupted or missing. Fix: copy "
                          "the directory again from where it was exported, or export the checkpoint again "
                          "(python -m megatron_triroute.export --checkpoint ...).") from None


def shard_files(directory: Path) -> dict[str, str]:
    """The `weight_map` (tensor name -> shard file) of `directory`'s index, refused unless every shard
    it names is a bare file name: a path such as `../x` or `/abs/x` would read outside the export."""
    index = directory / INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise ExportError(f"{index} is not a shard index ({type(error).__name__}: {error}). Fix: export the "
                          "checkpoint again.") from None
    if not isinstance(weight_map, dict):
        raise ExportError(f"{index}: weight_map is a {type(weight_map).__name__}, not a mapping. Fix: export the "
                          "checkpoint again.")
    for file in sorted(set(weight_map.values()), key=str):
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise ExportError(f"{index}: weight_map names the shard {file!r}, which is not a file name inside "
                              f"{directory} (an index names its shards by bare file name, e.g. "
                              "model-00001-of-00002.safetensors). Fix: export the checkpoint again; never read an "
                              "index whose shards point elsewhere.")
    return weight_map


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory (single file or index + shards), verified against the index."""
    directory = Path(directory)
    if (directory / INDEX).is_file():
        weight_map = shard_files(directory)
        out: dict[str, torch.Tensor] = {}
        for file in sorted(set(weight_map.values())):
            part = read_file(directory / file)
            stray = sorted(k for k in part if weight_map.get(k) != file)
            if stray:
                raise ExportError(f"{directory / file} holds {stray[:4]} which {INDEX} places elsewhere. "
                                  "Fix: re-export the directory.")
            out.update(part)
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise ExportError(f"{directory}: {INDEX} lists {missing[:4]} but no shard holds them. Fix: re-export.")
        return out
    if (directory / SINGLE).is_file():
        return read_file(directory / SINGLE)
    raise ExportError(f"{directory}: neither {SINGLE} nor {INDEX}. Fix: pass a Hugging Face model directory "
                      "written by `python -m megatron_triroute.export`.")
