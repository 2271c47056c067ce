"""The resume manifest: one JSON record per finished (stage, shard).

Records are separate files (`work/manifest/<stage>/<shard_id>.json`) rather than one shared JSON,
so the tasks of a Slurm array never write the same file. A record is written (atomically) only
after the shard's outputs are complete and renamed into place, and it stores the checksums of the
stage's inputs and outputs: a resumed run trusts a shard only when all of them still match.
`write_consolidated` gathers the records into `<output>/manifest.json` for people and tools.
"""

from __future__ import annotations

import json
from pathlib import Path
import os
from typing import Callable, Optional

from data_prep.atomic import TMP_MARK, publish_dir, remove_stale_tmp, sha256_file, write_json_atomic

RECORD_VERSION = 1


def record_path(work: Path, stage: str, shard_id: str) -> Path:
    return work / "manifest" / stage / f"{shard_id}.json"


def load_record(work: Path, stage: str, shard_id: str) -> Optional[dict]:
    path = record_path(work, stage, shard_id)
    try:
        record = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None  # absent or unreadable: the shard is simply not finished
    return record if record.get("version") == RECORD_VERSION else None


def remove_record(work: Path, stage: str, shard_id: str) -> None:
    record_path(work, stage, shard_id).unlink(missing_ok=True)


def output_checksums(directory: Path) -> dict[str, str]:
    return {child.name: sha256_file(child) for child in sorted(directory.iterdir()) if child.is_file()}


def outputs_intact(directory: Path, expected: dict[str, str]) -> bool:
    if not directory.is_dir():
        return False
    try:
        return output_checksums(directory) == expected
    except OSError:
        return False


def write_record(work: Path, stage: str, shard_id: str, record: dict) -> None:
    write_json_atomic(record_path(work, stage, shard_id), {**record, "version": RECORD_VERSION})


def write_consolidated(output: Path, work: Path, shard_ids: list[str]) -> None:
    stages: dict[str, dict] = {}
    for stage_dir in sorted((work / "manifest").glob("*")):
        records = {sid: load_record(work, stage_dir.name, sid) for sid in shard_ids}
        stages[stage_dir.name] = {sid: rec for sid, rec in records.items() if rec is not None}
    write_json_atomic(output / "manifest.json", {"stages": stages, "shards": shard_ids})


def rebuild_stage_output(work: Path, stage: str, shard_id: str, final_dir: Path,
                         produce: Callable[[Path], dict], record: Callable[[dict], dict]) -> dict:
    """Recompute one shard's output of a stage, crash-safely, and return `produce`'s stats.

    The order is the invariant: drop the record first (from then on the old outputs are not
    trusted), write into a fresh temporary directory, publish it by rename, and only then write the
    record with `record(stats)` plus the published files' checksums.
    """
    remove_record(work, stage, shard_id)
    root = final_dir.parent
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(root, shard_id)
    tmp = root / f"{shard_id}{TMP_MARK}{os.getpid()}"
    tmp.mkdir()
    stats = produce(tmp)
    publish_dir(tmp, final_dir)
    write_record(work, stage, shard_id, {**record(stats), "outputs": output_checksums(final_dir)})
    return stats
