"""Crash-safe file writing: write to a temporary name, fsync, then rename.

A reader (or a resumed run) therefore sees either the previous complete file or the new complete
file, never a half-written one. Temporary names contain `.tmp-` so leftovers are recognisable.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

TMP_MARK = ".tmp-"


def tmp_path_for(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")


def fsync_dir(directory: Path) -> None:
    # The rename is only durable once the directory entry itself is flushed.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any) -> None:
    # sort_keys + fixed indent: the same content always gives the same bytes.
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def write_npy_atomic(path: Path, array) -> None:
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array)
    write_bytes_atomic(path, buffer.getvalue())


def publish_file(tmp: Path, final: Path) -> None:
    """fsync a finished temporary file and rename it to its final name."""
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """fsync every file of a finished temporary directory, then swap it in for `final_dir`."""
    for child in tmp_dir.iterdir():
        if child.is_file():
            fsync_file(child)
    fsync_dir(tmp_dir)
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)


def remove_stale_tmp(directory: Path, stem: str) -> None:
    """Delete leftovers `<stem>.tmp-*` of an interrupted run (files or directories)."""
    if not directory.exists():
        return
    for child in directory.glob(f"{stem}{TMP_MARK}*"):
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
