"""The embedded default corpus: real stdlib code and prose, deterministic, in Pile format."""

from __future__ import annotations

from data_prep.corpus import CorpusConfig, build_corpus, docstrings
from dp_helpers import read_jsonl_zst, run_cli


def test_docstrings_in_source_order():
    source = '"""Module doc."""\n\nclass A:\n    """Class doc."""\n\n    def f(self):\n        """Method doc."""\n'
    assert docstrings(source) == "Module doc.\n\nClass doc.\n\nMethod doc."


def test_corpus_has_code_and_prose_shards(tmp_path, small_corpus):
    shards = sorted(small_corpus.glob("*.jsonl.zst"))
    assert [p.name for p in shards] == ["stdlib-00.jsonl.zst", "stdlib-01.jsonl.zst", "stdlib-02.jsonl.zst"]
    records = [r for shard in shards for r in read_jsonl_zst(shard)]
    assert len(records) == 60
    domains = {r["meta"]["pile_set_name"] for r in records}
    assert domains == {"Github", "StdlibDocs"}
    code = [r for r in records if r["meta"]["pile_set_name"] == "Github"]
    assert all(r["meta"]["path"].endswith(".py") for r in code)
    assert any("def " in r["text"] for r in code)
    assert not any("/test/" in "/" + r["meta"]["path"] or "/tests/" in "/" + r["meta"]["path"] for r in records)
    # Deterministic: writing it again gives the same bytes.
    again = tmp_path / "again"
    build_corpus(again, CorpusConfig(max_docs=60, shards=3))
    assert [p.read_bytes() for p in shards] == [(again / p.name).read_bytes() for p in shards]


def test_corpus_command(tmp_path):
    result = run_cli("corpus", "--output", str(tmp_path), "--max-docs", "8", "--shards", "2")
    assert result.returncode == 0, result.stderr
    assert sum(len(read_jsonl_zst(p)) for p in tmp_path.glob("*.jsonl.zst")) == 8
