"""Crash-safe files and directories: atomic writes, directory publish, fsync, checksums.

The one implementation behind the checkpoint store (`checkpoint/store.py`) and the data pipeline
(`data_prep/`). Standard library only, and `megatron_triroute/__init__.py` imports nothing eagerly,
so `import megatron_triroute.durability` costs no torch import: data_prep can use it freely.

Guarantees, for a process killed at any instant (a node failure, `os._exit`):
- `write_bytes_atomic` / `write_text_atomic` / `write_json_atomic`: the path holds the old complete
  content or the new complete content, never a mix; the new content is durable when they return.
- `publish_dir(tmp, final)`: the old complete directory or the new complete one is on disk at every
  instant. The steps are: fsync every file of `tmp` and `tmp` itself; rename `final` aside to
  `aside_path(final)`; rename `tmp` to `final`; delete the aside. Between the two renames `final`
  is absent but the old directory is whole under its aside name; `recover_dir(final)` (run before
  reading or publishing again) renames it back, or deletes a stale aside once `final` exists.
  Readers that must not write (several ranks at once) can use `resolve_dir(final)` instead.

Why not an atomic exchange (`renameat2(RENAME_EXCHANGE)`): it is Linux-only, not in the standard
library, and not supported by every cluster file system (Lustre, NFS); two renames and a known
aside name work everywhere.

Temporary names contain `TMP_MARK` and asides `ASIDE_MARK`, so leftovers are recognisable.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

TMP_MARK = ".tmp-"
ASIDE_MARK = ".publish-old"

CRASH_ENV = "TRIROUTE_DURABILITY_CRASH_AT"
"""Test hook: set to a step name of `publish_dir` ("synced", "aside", "swapped", "discarding") or of
`write_bytes_atomic` ("tmp_written", "replaced") and the process `os._exit(CRASH_EXIT_CODE)`s right
after that step, as a node failure would."""
CRASH_EXIT_CODE = 87


# ------------------------------------------------------------------------------------------- fsync


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Makes renames and new entries in `path` durable (POSIX needs the directory itself fsynced)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ writes


def tmp_path_for(path: Path) -> Path:
    """`<name>.tmp-<pid>` beside `path`: unique per process, recognisable as a leftover."""
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")


def write_durably(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to `path` in place and fsyncs it (for files inside a not-yet-published
    directory, which `publish_dir` makes visible atomically as a whole)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Temporary file, fsync, rename over `path`, fsync the directory: readers see the old content
    or the new, never a mix, and the new content survives a crash once this returns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    write_durably(tmp, data)
    _crash_point("tmp_written")
    os.replace(tmp, path)
    _crash_point("replaced")
    fsync_dir(path.parent)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Canonical JSON (sorted keys, indent 2, trailing newline): the same content always gives the
    same bytes, so outputs can be compared by checksum."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def publish_file(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """fsync a finished temporary file and rename it to its final name."""
    final = Path(final)
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


# ------------------------------------------------------------------------------------- directories


def aside_path(final: Path) -> Path:
    """Where `publish_dir` keeps the old `final` while the new one is renamed in."""
    return final.with_name(f"{final.name}{ASIDE_MARK}")


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Replace (or create) directory `final` with the finished directory `tmp`, crash-safely: at
    every instant the old or the new directory is whole on disk (see the module docstring)."""
    tmp, final = Path(tmp), Path(final)
    parent = final.parent
    recover_dir(final)  # a previous publish that died between its renames
    for child in tmp.iterdir():
        if child.is_file():
            fsync_file(child)
    fsync_dir(tmp)
    _crash_point("synced")
    aside = aside_path(final)
    had_old = final.exists()
    if had_old:
        os.rename(final, aside)
        fsync_dir(parent)
        _crash_point("aside")
    os.rename(tmp, final)
    fsync_dir(parent)
    _crash_point("swapped")
    if had_old:
        remove_tree(aside)


def remove_tree(path: Path) -> None:
    """Deletes a directory tree; under the crash hook's "discarding" step, dies after the first
    file, leaving a half-deleted tree as a real crash would."""
    if os.environ.get(CRASH_ENV) == "discarding":
        first = next((p for p in sorted(path.rglob("*")) if p.is_file()), None)
        if first is not None:
            first.unlink()
        _crash_point("discarding")
    shutil.rmtree(path, ignore_errors=True)


def recover_dir(final: str | os.PathLike) -> None:
    """Finish or undo a `publish_dir` that died: with `final` absent, its aside (the old, whole
    directory) is renamed back; with `final` present, a leftover aside is deleted."""
    final = Path(final)
    aside = aside_path(final)
    if not aside.is_dir():
        return
    if final.exists():
        remove_tree(aside)
    else:
        os.rename(aside, final)
        fsync_dir(final.parent)


def resolve_dir(final: str | os.PathLike) -> Path | None:
    """The directory that holds `final`'s complete content without modifying anything: `final`
    itself, or its aside while a publish is (or died) between its renames; None if neither."""
    final = Path(final)
    if final.is_dir():
        return final
    aside = aside_path(final)
    return aside if aside.is_dir() else None


def remove_stale_tmp(directory: str | os.PathLike, stem: str) -> None:
    """Delete leftovers `<stem>.tmp-*` of an interrupted run (files or directories)."""
    directory = Path(directory)
    if not directory.exists():
        return
    for child in directory.glob(f"{stem}{TMP_MARK}*"):
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()


# --------------------------------------------------------------------------------------- checksums


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def describe_file(path: str | os.PathLike) -> dict:
    """{"bytes", "sha256"} of a file: what a manifest records and `check_file` verifies."""
    return {"bytes": os.stat(path).st_size, "sha256": sha256_file(path)}


def check_file(path: str | os.PathLike, expected: dict, *, hashes: bool = True) -> str | None:
    """None when `path` matches `expected` (from `describe_file`), else what is wrong."""
    path = Path(path)
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{path.name} is {size} bytes, manifest says {expected['bytes']} (truncated or overwritten)"
    if hashes and sha256_file(path) != expected["sha256"]:
        return f"{path.name} sha256 does not match the manifest (corrupted)"
    return None


def _crash_point(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        os._exit(CRASH_EXIT_CODE)
