"""Turn `--input` paths/globs/directories into the canonical, sorted list of shards.

A shard is the unit of parallel work, of resume and of a Slurm array task's range:
one data file, or one directory of `.txt` files (one document per file).
Format detection looks at the file's first bytes first and its extension second, so a
mis-named file is still read correctly.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from data_prep.config import PrepError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
GZIP_MAGIC = b"\x1f\x8b"
PARQUET_MAGIC = b"PAR1"

FORMATS = ("jsonl", "jsonl.zst", "jsonl.gz", "parquet", "txt")
DATA_SUFFIXES = (".jsonl", ".json", ".jsonl.zst", ".json.zst", ".zst", ".jsonl.gz", ".json.gz", ".gz", ".parquet")
TEXT_SUFFIX = ".txt"


@dataclass(frozen=True)
class Shard:
    path: str
    """Absolute path of the file, or of the directory for a `txt` shard."""
    format: str
    """One of FORMATS."""

    @property
    def shard_id(self) -> str:
        """Stable name for this shard's intermediates: readable basename + hash of the full path
        (two `part-00.jsonl` in different directories must not collide)."""
        base = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(self.path.rstrip("/")) or "root")
        return f"{base[:60]}-{hashlib.sha256(self.path.encode()).hexdigest()[:10]}"


def detect_format(path: Path) -> str:
    """Format of one file: magic bytes decide compression/parquet, then the extension, then a
    sniff of the first non-blank byte (`{` means JSON lines)."""
    with open(path, "rb") as handle:
        head = handle.read(4096)
    name = path.name.lower()
    if head.startswith(PARQUET_MAGIC):
        return "parquet"
    if head.startswith(ZSTD_MAGIC):
        return "jsonl.zst"
    if head.startswith(GZIP_MAGIC):
        return "jsonl.gz"
    if name.endswith(TEXT_SUFFIX):
        return "txt"
    if name.endswith(".zst") and not head:
        return "jsonl.zst"  # an empty .zst file (truncated to nothing): read as an empty stream
    if name.endswith((".jsonl", ".json")) or head.lstrip()[:1] == b"{":
        return "jsonl"
    raise PrepError(
        f"input {str(path)!r}: cannot tell its format (first bytes {head[:16]!r}). Fix: pass "
        "JSON lines (.jsonl, .jsonl.zst, .jsonl.gz), parquet, or a directory of .txt files."
    )


def _expand_one(pattern: str) -> list[Shard]:
    matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
    if not matches:
        raise PrepError(f"input {pattern!r}: the glob matches nothing. Fix: check the pattern and quote it "
                        "so the shell does not expand it.")
    shards: list[Shard] = []
    for match in matches:
        path = Path(match).resolve()
        if not path.exists():
            raise PrepError(f"input {match!r}: no such file or directory. Fix: check the path.")
        if path.is_dir():
            shards.extend(_expand_directory(path))
        else:
            try:
                shards.append(Shard(str(path), detect_format(path)))
            except OSError as err:
                raise PrepError(f"input {match!r}: cannot be opened ({err}). Fix: check permissions.") from err
    return shards


def _expand_directory(directory: Path) -> list[Shard]:
    # Data files inside a directory are shards of their own; all .txt files under it form one
    # `txt` shard for the directory (a shard per tiny text file would be all overhead).
    shards: list[Shard] = []
    has_text = False
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            lower = name.lower()
            if lower.endswith(TEXT_SUFFIX):
                has_text = True
            elif lower.endswith(DATA_SUFFIXES):
                shards.append(Shard(str(Path(root, name)), detect_format(Path(root, name))))
    if has_text:
        shards.append(Shard(str(directory), "txt"))
    if not shards:
        raise PrepError(f"input directory {str(directory)!r} holds no .txt, .jsonl[.zst|.gz] or .parquet "
                        "files. Fix: point --input at the data.")
    return shards


def expand_inputs(patterns: list[str]) -> list[Shard]:
    """All shards, deduplicated by path and sorted by path: the canonical order."""
    by_path: dict[str, Shard] = {}
    for pattern in patterns:
        for shard in _expand_one(pattern):
            by_path[shard.path] = shard
    return [by_path[path] for path in sorted(by_path)]


def text_members(directory: str) -> list[Path]:
    """The `.txt` files of a `txt` shard in canonical (sorted relative path) order."""
    root = Path(directory)
    if root.is_file():
        return [root]
    members = []
    for current, dirs, files in os.walk(root):
        dirs.sort()
        members.extend(Path(current, name) for name in sorted(files) if name.lower().endswith(TEXT_SUFFIX))
    return members


def task_range(num_shards: int, task_index: int, num_tasks: int) -> range:
    """Contiguous shard range of one array task: [floor(i*N/n), floor((i+1)*N/n))."""
    if num_tasks < 1 or not 0 <= task_index < num_tasks:
        raise PrepError(f"task_index={task_index!r} with num_tasks={num_tasks!r}: need 0 <= task_index < "
                        "num_tasks. Fix: pass SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN and SLURM_ARRAY_TASK_COUNT.")
    return range(task_index * num_shards // num_tasks, (task_index + 1) * num_shards // num_tasks)
