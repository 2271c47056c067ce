"""Kill the command mid-shard, run it again: the outputs equal an uninterrupted run's, byte for byte."""

from __future__ import annotations

import json
import shutil

import pytest

from data_prep.crash_hook import CRASH_ENV, CRASH_EXIT_CODE
from dp_helpers import CORPUS_OPTIONS, build, output_bytes, run_cli, summary

SECOND_SHARD = "stdlib-01.jsonl.zst"


def _records(output, stage):
    return {p.name.split(".jsonl.zst")[0]: p for p in (output / "work" / "manifest" / stage).glob("*.json")}


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("stage", ["parse", "tokenize"])
def test_resume_after_kill_mid_shard_is_byte_identical(tmp_path, small_corpus, corpus_reference, stage, workers):
    out = tmp_path / "out"
    args = ["build", "--input", str(small_corpus), "--output", str(out), "--workers", workers, *CORPUS_OPTIONS]
    crashed = run_cli(*args, env={CRASH_ENV: f"{stage}:{SECOND_SHARD}:5"})
    assert crashed.returncode != 0, crashed.stderr
    if workers == "1":
        assert crashed.returncode == CRASH_EXIT_CODE
    # The interrupted shard left a half-written temporary directory and no manifest record.
    assert list((out / "work").glob("*/stdlib-01*.tmp-*")), "expected a half-written temporary output"
    assert "stdlib-01" not in _records(out, stage)
    assert not (out / "summary.json").exists()
    finished_before = {name: path.stat().st_mtime_ns for name, path in _records(out, stage).items()}

    assert build(out, [small_corpus], *CORPUS_OPTIONS, "--workers", workers) == 0
    assert output_bytes(out) == output_bytes(corpus_reference)
    assert not list((out / "work").glob("*/*.tmp-*"))
    if workers == "1":
        # stdlib-00 finished before the kill: verified by checksum and skipped, not redone.
        assert finished_before["stdlib-00"] == _records(out, stage)["stdlib-00"].stat().st_mtime_ns


def test_damaged_finished_output_is_redone(tmp_path, small_corpus, corpus_reference):
    out = tmp_path / "out"
    assert build(out, [small_corpus], *CORPUS_OPTIONS) == 0
    parsed = next((out / "work" / "parsed").glob("stdlib-01*"))
    (parsed / "docs.jsonl.zst").write_bytes(b"garbage")  # e.g. a disk error after the record was written
    assert build(out, [small_corpus], *CORPUS_OPTIONS) == 0
    assert output_bytes(out) == output_bytes(corpus_reference)


def test_changed_input_is_reparsed(tmp_path, small_corpus):
    import zstandard

    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    out = tmp_path / "out"
    assert build(out, [corpus], *CORPUS_OPTIONS) == 0
    before = summary(out)["documents"]["read"]
    shard = corpus / "stdlib-02.jsonl.zst"
    extra = json.dumps({"text": "One more document, appended later.", "meta": {"pile_set_name": "X"}}).encode()
    shard.write_bytes(shard.read_bytes() + zstandard.ZstdCompressor().compress(extra + b"\n"))
    assert build(out, [corpus], *CORPUS_OPTIONS) == 0
    assert summary(out)["documents"]["read"] == before + 1
