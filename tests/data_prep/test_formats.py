"""Format detection (magic bytes first, extension second) and reading of every supported format."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_prep.config import PrepError
from data_prep.inputs import detect_format, expand_inputs, task_range
from data_prep.readers import ShardReader, input_sha256
from data_prep.records import Document
from dp_helpers import FIXTURES, build, summary

FORMATS = FIXTURES / "formats"


@pytest.mark.parametrize("name, fmt", [
    ("pile.jsonl.zst", "jsonl.zst"),
    ("redpajama.parquet", "parquet"),
    ("plain.jsonl.gz", "jsonl.gz"),
    ("mislabelled.jsonl", "jsonl.gz"),  # gzip bytes under a .jsonl name: the magic wins
    ("txtdir/a.txt", "txt"),
])
def test_detect_format(name, fmt):
    assert detect_format(FORMATS / name) == fmt


def test_unknown_format_is_a_clear_error(tmp_path):
    odd = tmp_path / "data.bin"
    odd.write_bytes(b"\x00\x01binary")
    with pytest.raises(PrepError, match="cannot tell its format"):
        detect_format(odd)


def test_directory_expands_to_sorted_shards_and_one_txt_shard():
    # Data files are shards of their own; all .txt files under the directory argument form one
    # `txt` shard named by that directory (which sorts before the files inside it).
    shards = expand_inputs([str(FORMATS)])
    assert [(Path(s.path).name, s.format) for s in shards] == [
        ("formats", "txt"), ("mislabelled.jsonl", "jsonl.gz"), ("pile.jsonl.zst", "jsonl.zst"),
        ("plain.jsonl.gz", "jsonl.gz"), ("redpajama.parquet", "parquet")]
    assert [Path(s.path).name for s in expand_inputs([str(FORMATS / "txtdir")])] == ["txtdir"]


def _read(shard):
    reader = ShardReader(shard, "text")
    outcomes = list(reader)
    assert reader.sha256 == input_sha256(shard)  # the resume check recomputes the same checksum
    return [(o.text, o.domain) for o in outcomes if isinstance(o, Document)]


def test_each_format_reads_its_documents_and_domains():
    by_name = {Path(s.path).name: s for s in expand_inputs([str(FORMATS)])}
    assert _read(by_name["pile.jsonl.zst"]) == [("Pile document one.", "Pile-CC"), ("print('pile code')\n", "Github")]
    assert _read(by_name["redpajama.parquet"]) == [("RedPajama parquet row one.", "RedPajamaBook"),
                                                   ("RedPajama parquet row two.", "RedPajamaGithub")]
    assert _read(by_name["plain.jsonl.gz"]) == [("Gzip line one.", ""), ("Gzip line two.", "")]
    assert _read(by_name["mislabelled.jsonl"]) == [("Gzip data under a .jsonl name.", "")]
    assert _read(by_name["formats"]) == [("Text file A.\nSecond line of A.\n", ""), ("Text file B in a subdirectory.", "")]


def test_text_field_is_configurable_for_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["Custom column."], "text": ["Not this one."]}), tmp_path / "c.parquet")
    shard = expand_inputs([str(tmp_path / "c.parquet")])[0]
    assert [o.text for o in ShardReader(shard, "content")] == ["Custom column."]


def test_build_over_all_formats(tmp_path):
    assert build(tmp_path / "out", [FORMATS], "--vocab-size", "300", "--valid-fraction", "0.2") == 0
    docs = summary(tmp_path / "out")["documents"]
    assert docs["read"] == 2 + 2 + 2 + 1 + 2 and docs["rejected"]["total"] == 0 and docs["duplicates"] == 0


def test_task_ranges_cover_every_shard_once():
    assert [list(task_range(5, i, 3)) for i in range(3)] == [[0], [1, 2], [3, 4]]
    assert [list(task_range(2, i, 4)) for i in range(4)] == [[], [0], [], [1]]
    with pytest.raises(PrepError, match="task_index"):
        task_range(5, 3, 3)


def test_txt_rejects_name_the_file(tmp_path):
    (tmp_path / "a.txt").write_text("Good text file.", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"caf\xe9 in latin-1")
    (tmp_path / "c.txt").write_text(" \n ", encoding="utf-8")
    outcomes = list(ShardReader(expand_inputs([str(tmp_path)])[0], "text"))
    assert [(o.number, getattr(o, "reason", "ok"), getattr(o, "member", None)) for o in outcomes] == [
        (1, "ok", None), (2, "invalid_utf8", "b.txt"), (3, "empty_document", "c.txt")]
