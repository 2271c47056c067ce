"""Sharded checkpoints that are either complete and verified, or ignored.

Layout under `root`:

    latest                      "step_00000200\\n": the commit point, replaced atomically
    step_00000100/              an older complete checkpoint (kept by keep_last)
    step_00000200/
        manifest.json           format, version, step, world_size, bytes + sha256 of every file
        meta.json               the caller's JSON metadata (config, data position, ...), from rank 0
        rank_00000.safetensors  rank 0's tensors, dotted keys
        rank_00000.json         rank 0's tree skeleton and plain values (see tree.py)
        rank_00001.safetensors  ...
    .tmp-step_00000300/         a save in progress or one that died: never read, removed by the next save
    step_00000400.set-aside-T/  a checkpoint pruning or train.start_fresh would otherwise have dropped
                                unverified: never read, never deleted

A save is committed only when `latest` names it. Every file is fsynced before the manifest is
written; the directory is published (`durability.publish_dir`: re-saving an existing step swaps it
with no window where neither the old nor the new directory exists) and the parent fsynced before
`latest` moves. A crash at any point therefore leaves `latest` on the previous checkpoint. Loading verifies sizes and sha256
of every file against the manifest (once per process for an unchanged directory; a trainer resume
shares the checksums between its ranks) and falls back, with a warning, to the newest older
checkpoint that verifies; with checkpoints present and none verifying it raises
`NoVerifiedCheckpointError` rather than letting a run start over them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..durability import (
    ASIDE_MARK, check_file, describe_file, fsync_dir, fsync_file, publish_dir, recover_dir, resolve_dir, write_durably,
    write_text_atomic,
)
from ..input_errors import InputError
from .tree import flatten_tree, unflatten_tree

log = logging.getLogger(__name__)

FORMAT_NAME = "megatron-triroute-checkpoint"
FORMAT_VERSION = 1
LATEST_FILE = "latest"
MANIFEST_FILE = "manifest.json"
META_FILE = "meta.json"
EXTRA_DIR = "sharded"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
SET_ASIDE_MARK = ".set-aside-"
_STEP_DIR = re.compile(r"step_(\d{8,})")
_ASIDE_DIR = re.compile(r"(step_\d{8,})" + re.escape(ASIDE_MARK))

CRASH_ENV = "TRIROUTE_CHECKPOINT_CRASH_AT"
"""Test hook: set to a phase name ("after_shard", "before_rename", "before_latest"; for an
asynchronous save also "background_write": right after the write is handed to the background
process) and every rank of a save `os._exit(CRASH_EXIT_CODE)`s there, as a node failure would."""
CRASH_EXIT_CODE = 86


class CheckpointError(InputError, RuntimeError):
    """A checkpoint cannot be used; the message says which file and why."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No valid checkpoint exists under the root."""


class NoVerifiedCheckpointError(CheckpointNotFoundError):
    """The root holds checkpoints (or a `latest` pointer) but none of them verifies: a run must not
    silently start again from step 0 over them. The message names each and why it failed."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    world_size: int


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def split_step_dir(path: str | os.PathLike) -> tuple[Path, int | None]:
    """(checkpoint root, step) for one `step_*` directory; (path, None) for anything else (a root)."""
    path = Path(path)
    match = _STEP_DIR.fullmatch(path.name)
    return (path.parent, int(match.group(1))) if match else (path, None)


def shard_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def skeleton_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def _digest_file_name(rank: int) -> str:
    return f".rank_{rank:05d}.digest.json"


_DIGEST = re.compile(r"\.rank_\d{5,}\.digest\.json")


# -------------------------------------------------------------------------------------------- save


@dataclass
class ExtraWrite:
    """What `write_extra` leaves to do on its rank: `run()` writes the heavy files and returns the
    paths it wrote (an asynchronous save runs it in a background process while training goes on);
    `finalize()`, collective, runs on every rank once every rank's `run` has returned and returns the
    paths it wrote (e.g. Megatron's metadata on rank 0)."""

    run: Callable[[], list[Path]]
    finalize: Callable[[], list[Path]] = list


@dataclass
class PendingSave:
    """A save whose per-rank files are written and whose heavy write and commit are still to run.

    `background()` runs this rank's `ExtraWrite.run`, then fsyncs and hashes every file the rank
    wrote into its digest; it touches only this rank's files, so it may run in another process.
    `commit()`, collective, runs once `background()` has returned on every rank: each rank adds the
    files its `ExtraWrite.finalize` wrote to its digest, then rank 0 writes the manifest, publishes
    the directory, moves `latest` and prunes. Until `commit` returns, `latest` names the previous
    checkpoint."""

    step: int
    path: Path
    """The directory the checkpoint will have once committed."""
    background: Callable[[], None]
    commit: Callable[[], Path]


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    rank_states: Any,
    meta: dict,
    *,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
    keep_last: int | None = None,
    write_extra: Callable[[Path], Any] | None = None,
) -> Path:
    """Writes this rank's tree as one shard and, on rank 0, commits the checkpoint. Collective:
    every rank calls it with the same step; `barrier` must block until all ranks reach it (e.g.
    `torch.distributed.barrier`). Returns the committed directory once every rank's files and the
    `latest` pointer are durable.

    `meta` (JSON) is taken from rank 0. `keep_last=K` then keeps the K newest checkpoints at or below
    this step, removes older ones that still verify, and sets aside (never deletes) older ones that
    do not and any newer ones (an abandoned timeline left behind when a run resumed from an older
    checkpoint): see `_prune`.

    `write_extra(directory)`, called collectively on every rank before the shards are written,
    may add files under `directory/EXTRA_DIR` (e.g. a Megatron sharded checkpoint). It returns the
    paths it wrote on this rank, or an `ExtraWrite` that writes them later. Each rank fsyncs and
    hashes the files it wrote itself; the manifest collects them like every other file.

    `begin_save` takes the same arguments and leaves the heavy write and the commit to its caller
    (an asynchronous save)."""
    pending = begin_save(root, step, rank_states, meta, rank=rank, world_size=world_size, barrier=barrier,
                         keep_last=keep_last, write_extra=write_extra)
    pending.background()
    (barrier or (lambda: None))()
    return pending.commit()


def begin_save(
    root: str | os.PathLike,
    step: int,
    rank_states: Any,
    meta: dict,
    *,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
    keep_last: int | None = None,
    write_extra: Callable[[Path], Any] | None = None,
) -> PendingSave:
    """The synchronous part of `save_checkpoint` (same arguments): the save directory, `write_extra`,
    and this rank's shard, skeleton (and on rank 0 meta), written, fsynced and hashed. Returns the
    rest as a `PendingSave`. Collective."""
    if world_size > 1 and barrier is None:
        raise ValueError(f"save_checkpoint with world_size={world_size} needs a barrier callable")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, {world_size})")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1 (or None to keep every checkpoint)")
    sync = barrier or (lambda: None)
    root = Path(root)
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}"
    final = root / step_dir_name(step)
    # Reject unserialisable input before the first barrier and before touching the disk.
    meta_text = _to_json(meta, what="meta")
    tensors, skeleton = flatten_tree(rank_states)
    skeleton_text = _to_json(skeleton, what=f"rank {rank} state")

    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        tmp.mkdir()
        fsync_dir(root)
    sync()

    extra = _as_extra_write(write_extra(tmp / EXTRA_DIR)) if write_extra is not None else ExtraWrite(list)
    shard, skeleton_file = tmp / shard_file_name(rank), tmp / skeleton_file_name(rank)
    save_file(tensors, shard, metadata={"format": FORMAT_NAME, "step": str(step), "rank": str(rank)})
    fsync_file(shard)
    _crash_point("after_shard")
    write_durably(skeleton_file, skeleton_text.encode())
    written = [shard, skeleton_file]
    if rank == 0:
        write_durably(tmp / META_FILE, meta_text.encode())
        written.append(tmp / META_FILE)
    # Hashed by the rank that wrote them, while they are hot in its page cache.
    described = _describe(tmp, written)

    def background() -> None:
        _write_digest(tmp, rank, {**described, **_describe(tmp, extra.run(), fsync=True)})

    def commit() -> Path:
        late = extra.finalize()
        if late:
            digest = tmp / _digest_file_name(rank)
            _write_digest(tmp, rank, {**json.loads(digest.read_text()), **_describe(tmp, late, fsync=True)})
        sync()
        if rank == 0:
            _commit(root, tmp, final, step, world_size)
            if keep_last is not None:
                _prune(root, step, keep_last)
        sync()  # nobody returns (and maybe exits) before the checkpoint is committed
        return final

    return PendingSave(step, final, background, commit)


def _as_extra_write(returned: Any) -> ExtraWrite:
    if isinstance(returned, ExtraWrite):
        return returned
    if returned is None or isinstance(returned, (str, bytes)) or not isinstance(returned, Iterable):
        raise TypeError(f"write_extra returned {type(returned).__name__}: it must return the paths it wrote on this "
                        "rank (a list, empty if none), or an ExtraWrite")
    paths = [Path(p) for p in returned]
    return ExtraWrite(lambda: paths)


def _describe(tmp: Path, paths: Iterable[Path], *, fsync: bool = False) -> dict[str, dict]:
    """{path relative to `tmp`: bytes + sha256} of files this rank wrote (fsynced first if asked)."""
    out = {}
    for path in paths:
        if fsync:
            fsync_file(path)
        out[Path(path).relative_to(tmp).as_posix()] = describe_file(path)
    return out


def _write_digest(tmp: Path, rank: int, described: dict[str, dict]) -> None:
    """This rank's part of the manifest, durable with the directory entries of its files."""
    for directory in sorted({(tmp / name).parent for name in described}):
        fsync_dir(directory)
    write_durably(tmp / _digest_file_name(rank), json.dumps(described).encode())
    fsync_dir(tmp)


def _commit(root: Path, tmp: Path, final: Path, step: int, world_size: int) -> None:
    files: dict[str, dict] = {}
    for rank in range(world_size):
        digest = tmp / _digest_file_name(rank)
        if not digest.is_file():
            raise CheckpointError(f"{digest} is missing: rank {rank} did not finish writing its files; "
                                  f"{step_dir_name(step)} is not committed")
        files.update(json.loads(digest.read_text()))
    unlisted = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*")
                      if p.is_file() and not _DIGEST.fullmatch(p.name) and p.relative_to(tmp).as_posix() not in files)
    if unlisted:
        raise CheckpointError(f"{tmp}: {unlisted[:5]} written but described by no rank (a write_extra must return "
                              "every file it writes)")
    for name, expected in files.items():
        actual = (tmp / name).stat().st_size
        if actual != expected["bytes"]:
            raise CheckpointError(f"{tmp / name}: {actual} bytes on disk, its rank wrote {expected['bytes']}")
    for rank in range(world_size):
        (tmp / _digest_file_name(rank)).unlink()
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "created_unix": time.time(),
        "files": dict(sorted(files.items())),
    }
    write_durably(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)
    _crash_point("before_rename")
    # Re-saving a step (resumed from an older one): the new save wins, swapped in with no window.
    publish_dir(tmp, final)
    _crash_point("before_latest")
    write_text_atomic(root / LATEST_FILE, final.name + "\n")


def _prune(root: Path, latest_step: int, keep_last: int) -> None:
    """Removes checkpoints older than the `keep_last` newest at or below `latest_step` when they
    still verify (sizes against their manifest): superseded, whole copies. Anything else it would
    drop is set aside instead (`set_aside`): a directory newer than `latest` (never committed, or a
    timeline a resume abandoned) and one that fails verification may be the only copy of work
    someone needs, so pruning never deletes it."""
    steps = sorted(_step_dirs(root))
    older = [s for s in steps if s < latest_step]
    superseded = older[: max(0, len(older) - (keep_last - 1))]
    for step in steps:
        path = root / step_dir_name(step)
        if step > latest_step:
            set_aside(path, f"newer than {LATEST_FILE} ({step_dir_name(latest_step)}): never committed or abandoned")
        elif step in superseded:
            problem, _ = _verify(path, step, hashes=False)
            if problem is None:
                log.info("pruning checkpoint %s (keep_last=%d)", path, keep_last)
                _discard(path)
            else:
                set_aside(path, f"failed verification ({problem})")


def set_aside(path: Path, why: str) -> Path:
    """Renames a `step_*` directory to `<name>.set-aside-<unix time>`: never read as a checkpoint,
    never deleted by this code; the user decides. Returns the new path."""
    target = path.with_name(f"{path.name}{SET_ASIDE_MARK}{int(time.time())}")
    n = 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{SET_ASIDE_MARK}{int(time.time())}.{n}")
    os.rename(path, target)
    fsync_dir(path.parent)
    log.warning("set aside %s as %s: %s. It is not read or deleted again; inspect it, then delete it "
                "or rename it back.", path, target.name, why)
    return target


def set_aside_all(root: str | os.PathLike, why: str) -> list[Path]:
    """Sets aside every checkpoint under `root` and removes the `latest` pointer (a run that starts
    fresh on purpose over checkpoints it cannot or will not use). Returns the new paths."""
    root = Path(root)
    moved = [set_aside(path, why) for _, path in sorted(_step_dirs(root).items())]
    (root / LATEST_FILE).unlink(missing_ok=True)
    if root.is_dir():
        fsync_dir(root)
    return moved


def _discard(path: Path) -> None:
    """Renames first, so a half-deleted directory never looks like a checkpoint."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    for entry in root.iterdir():
        aside = _ASIDE_DIR.fullmatch(entry.name)
        if aside and entry.is_dir():  # a re-save that died between its renames: restore or drop the old
            log.warning("repairing %s left by an interrupted re-save", entry)
            recover_dir(root / aside.group(1))
        elif entry.is_dir() and entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            log.warning("removing leftover %s from an interrupted save or prune", entry)
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.is_file() and entry.name.startswith((f".{LATEST_FILE}.tmp-", f"{LATEST_FILE}.tmp-")):
            entry.unlink(missing_ok=True)


# -------------------------------------------------------------------------------------------- load


def load_checkpoint(
    root: str | os.PathLike,
    rank: int = 0,
    *,
    world_size: int | None = None,
    step: int | None = None,
    device: str | torch.device = "cpu",
) -> tuple[int, Any, dict]:
    """Returns `(step, rank_state_tree, meta)` from the newest valid checkpoint (or exactly `step`).

    Every rank verifies every file, so all ranks pick the same step without communicating. Passing
    `world_size` checks it against the checkpoint's; when the data-parallel size changed, use
    `load_shards` and merge.
    """
    info = _select(Path(root), step)
    if world_size is not None and world_size != info.world_size:
        raise CheckpointError(
            f"{info.path} was written by {info.world_size} ranks, this run has {world_size}: "
            "load every shard with load_shards() and re-shard"
        )
    if not 0 <= rank < info.world_size:
        raise CheckpointError(f"{info.path} has ranks 0..{info.world_size - 1}, asked for rank {rank}")
    return info.step, _read_shard(info.path, rank, device), _read_meta(info.path)


def load_shards(
    root: str | os.PathLike,
    ranks: Iterable[int] | None = None,
    *,
    step: int | None = None,
    device: str | torch.device = "cpu",
) -> tuple[int, dict[int, Any], dict]:
    """Returns `(step, {rank: tree}, meta)` with the shards of `ranks` (default: all) of the newest
    valid checkpoint, so a run with a different world size can merge and re-split them."""
    info = _select(Path(root), step)
    wanted = range(info.world_size) if ranks is None else list(ranks)
    for rank in wanted:
        if not 0 <= rank < info.world_size:
            raise CheckpointError(f"{info.path} has ranks 0..{info.world_size - 1}, asked for rank {rank}")
    shards = {rank: _read_shard(info.path, rank, device) for rank in wanted}
    return info.step, shards, _read_meta(info.path)


def list_checkpoints(root: str | os.PathLike, *, verify: bool = False) -> list[CheckpointInfo]:
    """Committed-looking checkpoints (a `step_*` directory with a readable manifest), oldest first.
    With `verify=True` only those whose every file matches its manifest."""
    found = []
    for step, path in sorted(_step_dirs(Path(root)).items()):
        problem, manifest = _verify(path, step, hashes=verify)
        if problem is None:
            found.append(CheckpointInfo(step, path, manifest["world_size"]))
    return found


def latest_valid_checkpoint(root: str | os.PathLike) -> CheckpointInfo | None:
    """What `load_checkpoint` would load, or None for a fresh run (no checkpoint and no `latest`
    pointer). Raises `NoVerifiedCheckpointError` when checkpoints exist but none verifies."""
    try:
        return _select(Path(root), None)
    except NoVerifiedCheckpointError:
        raise
    except CheckpointNotFoundError:
        return None


def checkpoint_candidates(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """The `step_*` directories a resume tries, in order: the one `latest` names, then older ones,
    newest first (all of them newest first without a usable pointer). Empty for a fresh root."""
    root = Path(root)
    dirs = _step_dirs(root)
    pointed = _read_latest(root)
    if pointed is None:
        if dirs:
            log.warning("%s has no usable '%s' pointer; trying step directories newest first", root, LATEST_FILE)
        candidates = sorted(dirs, reverse=True)
    else:
        newer = sorted(s for s in dirs if s > pointed)
        if newer:
            log.warning(
                "ignoring %s: newer than '%s' (%s), so never committed or from an abandoned run",
                ", ".join(step_dir_name(s) for s in newer), LATEST_FILE, step_dir_name(pointed),
            )
        candidates = [pointed] + sorted((s for s in dirs if s < pointed), reverse=True)
    return [(step, dirs.get(step, root / step_dir_name(step))) for step in candidates]


def no_verified_checkpoint(root: str | os.PathLike, problems: list[str]) -> NoVerifiedCheckpointError:
    """The error for a root whose checkpoints all failed verification: each, why, and the fixes."""
    return NoVerifiedCheckpointError(
        f"no valid checkpoint under {root}: " + "; ".join(problems) + ". Nothing was deleted. Fix: restore the "
        "files (e.g. from a copy), or resume from a checkpoint elsewhere with train.init_from=PATH and another "
        "output_dir, or start this run again from step 0 on purpose with train.start_fresh=true (the "
        "checkpoints are set aside as step_*" + SET_ASIDE_MARK + "*, not deleted).")


def _select(root: Path, step: int | None) -> CheckpointInfo:
    if step is not None:
        path = resolve_dir(root / step_dir_name(step)) or root / step_dir_name(step)
        problem, manifest = _verify(path, step)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} is unusable: {problem}")
        return CheckpointInfo(step, path, manifest["world_size"])

    problems = []
    for candidate, path in checkpoint_candidates(root):
        problem, manifest = _verify(path, candidate)
        if problem is None:
            if problems:
                log.warning("falling back to checkpoint %s", path)
            return CheckpointInfo(candidate, path, manifest["world_size"])
        log.warning("checkpoint %s is unusable: %s", path, problem)
        problems.append(f"{path.name}: {problem}")
    if not problems:
        raise CheckpointNotFoundError(f"no checkpoint under {root}")
    raise no_verified_checkpoint(root, problems)


_VERIFIED: dict[str, tuple] = {}
"""Checkpoint directories this process has verified in full, by path: the (size, mtime, inode) of
the manifest and every file at that time. A later check of an unchanged directory is a stat of
each file, not another read of every byte (resume and export look at one checkpoint several times)."""


def _fingerprint(path: Path, names: Iterable[str]) -> tuple:
    stats = [os.stat(path / name) for name in [MANIFEST_FILE, *names]]
    return tuple((s.st_size, s.st_mtime_ns, s.st_ino) for s in stats)


def verify_checkpoint(path: str | os.PathLike, step: int, *, share: tuple[int, int] | None = None,
                      hashes: bool = True) -> tuple[str | None, dict]:
    """(None, manifest) when the checkpoint verifies, else (what is wrong, {}).

    Sizes are always checked against the manifest. `share=(k, n)`: only the sha256 of rank k's
    share of the files (`checksum_share`, balanced by bytes) is checked, so n ranks that each check
    their share and agree (all-reduce) read every byte once between them; the caller then calls
    `trust_verified` on every rank. Without `share` every checksum is checked here."""
    return _verify(Path(path), step, hashes=hashes, share=share)


def checksum_share(files: dict[str, dict], k: int, n: int) -> list[str]:
    """The files whose sha256 rank `k` of `n` checks: the manifest's files, largest first, each to
    the rank with the fewest bytes so far (the same split on every rank; each byte on one rank)."""
    load = [0] * n
    mine = []
    for name in sorted(files, key=lambda f: (-files[f]["bytes"], f)):
        owner = min(range(n), key=lambda r: (load[r], r))
        load[owner] += files[name]["bytes"]
        if owner == k:
            mine.append(name)
    return sorted(mine)


def trust_verified(path: str | os.PathLike) -> None:
    """Records `path` as verified in full (by ranks that checked it between them)."""
    path = Path(path)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    _VERIFIED[str(path)] = _fingerprint(path, manifest["files"])


def _verify(path: Path, step: int, *, hashes: bool = True,
            share: tuple[int, int] | None = None) -> tuple[str | None, dict]:
    """(None, manifest) when every file matches the manifest, else (what is wrong, {})."""
    if not path.is_dir():
        return "directory is missing", {}
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        return f"{MANIFEST_FILE} is missing", {}
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{MANIFEST_FILE} is unreadable ({error})", {}
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        return f"{MANIFEST_FILE} is not a {FORMAT_NAME} manifest", {}
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"format_version {manifest.get('format_version')!r}, this code reads {FORMAT_VERSION}", {}
    if manifest.get("step") != step:
        return f"{MANIFEST_FILE} says step {manifest.get('step')!r}, directory says {step}", {}
    files = manifest.get("files", {})
    world_size = manifest.get("world_size")
    if not isinstance(world_size, int) or world_size < 1:
        return f"{MANIFEST_FILE} has world_size {world_size!r}", {}
    required = [META_FILE] + [f(r) for r in range(world_size) for f in (shard_file_name, skeleton_file_name)]
    for name in required:
        if name not in files:
            return f"{MANIFEST_FILE} does not list {name}", {}
    names = sorted(files)
    for name in names:  # sizes first: a truncated file is found without reading anything
        problem = check_file(path / name, files[name], hashes=False)
        if problem is not None:
            return problem, {}
    if not hashes:
        return None, manifest
    if _VERIFIED.get(str(path)) == _fingerprint(path, names):
        return None, manifest
    for name in names if share is None else checksum_share(files, *share):
        problem = check_file(path / name, files[name], hashes=True)
        if problem is not None:
            return problem, {}
    if share is None:
        _VERIFIED[str(path)] = _fingerprint(path, names)
    return None, manifest


def _read_shard(path: Path, rank: int, device: str | torch.device) -> Any:
    try:
        tensors = load_file(path / shard_file_name(rank), device=str(device))
        skeleton = json.loads((path / skeleton_file_name(rank)).read_text())
    except (OSError, SafetensorError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: cannot read rank {rank}'s shard: {error}") from error
    return unflatten_tree(skeleton, tensors)


def _read_meta(path: Path) -> dict:
    return json.loads((path / META_FILE).read_text())


def _read_latest(root: Path) -> int | None:
    try:
        text = (root / LATEST_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        log.warning("cannot read %s: %s", root / LATEST_FILE, error)
        return None
    match = _STEP_DIR.fullmatch(text)
    if match is None:
        log.warning("%s holds %r, not a step directory name", root / LATEST_FILE, text[:80])
        return None
    return int(match.group(1))


def _step_dirs(root: Path) -> dict[int, Path]:
    if not root.is_dir():
        return {}
    found, asides = {}, {}
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found[int(match.group(1))] = entry
        aside = _ASIDE_DIR.fullmatch(entry.name)
        if aside and entry.is_dir():  # the old copy of a step whose re-save died between its renames
            asides[int(aside.group(1)[len("step_"):])] = entry
    return {**asides, **found}


# ------------------------------------------------------------------------------------------ misc


def _to_json(value: Any, *, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(f"checkpoint {what} is not JSON-serialisable: {error}") from error


def _crash_point(phase: str) -> None:
    if os.environ.get(CRASH_ENV) == phase:
        os._exit(CRASH_EXIT_CODE)
