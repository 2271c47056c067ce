"""Bad input loses nothing and stops nothing: every record is written, a duplicate, or a counted reject.

Counts are read off the fixture by hand (tests/fixtures/data_prep/make_fixtures.py lists every line).
"""

from __future__ import annotations

import base64
import json

import pytest

from dp_helpers import FIXTURES, build, summary

BAD = FIXTURES / "bad_inputs"

# (file, line) -> reason, for every record that must be rejected.
EXPECTED_REJECTS = {
    ("a-pile.jsonl.zst", 3): "malformed_json",
    ("a-pile.jsonl.zst", 4): "invalid_utf8",
    ("a-pile.jsonl.zst", 5): "missing_text_field",
    ("a-pile.jsonl.zst", 6): "non_string_text",
    ("a-pile.jsonl.zst", 7): "non_string_text",
    ("a-pile.jsonl.zst", 8): "empty_document",
    ("a-pile.jsonl.zst", 9): "empty_document",
    ("a-pile.jsonl.zst", 10): "blank_line",
    ("a-pile.jsonl.zst", 11): "not_a_json_object",
    ("a-pile.jsonl.zst", 14): "invalid_utf8",
    ("b-truncated.jsonl.zst", 4): "truncated_stream",
}


@pytest.fixture(scope="module")
def bad_build(tmp_path_factory):
    output = tmp_path_factory.mktemp("bad")
    assert build(output, [BAD], "--vocab-size", "320", "--valid-fraction", "0.3") == 0
    return output


def test_counts_per_reason_match_the_fixture(bad_build):
    docs = summary(bad_build)["documents"]
    assert docs["rejected"]["by_reason"] == {
        "malformed_json": 1, "invalid_utf8": 2, "missing_text_field": 1, "non_string_text": 2,
        "empty_document": 2, "blank_line": 1, "not_a_json_object": 1, "truncated_stream": 1,
    }
    # a-pile: 14 lines; b-truncated: 3 readable lines + the truncation; c-plain: 4 lines.
    assert docs["read"] == 14 + 4 + 4
    # Two duplicates: b-truncated line 3 (same normal form as a-pile 12), c-plain line 2 (= a-pile 1).
    assert docs["duplicates"] == 2
    assert docs["written"]["total"] == 22 - 2 - 11 == 9
    assert docs["read"] == docs["written"]["total"] + docs["duplicates"] + docs["rejected"]["total"]


def test_per_input_accounting(bad_build):
    by_name = {entry["path"].rsplit("/", 1)[1]: entry for entry in summary(bad_build)["inputs"]}
    assert (by_name["a-pile.jsonl.zst"]["read"], by_name["a-pile.jsonl.zst"]["accepted"]) == (14, 4)
    assert (by_name["b-truncated.jsonl.zst"]["read"], by_name["b-truncated.jsonl.zst"]["accepted"]) == (4, 3)
    assert (by_name["c-plain.jsonl"]["read"], by_name["c-plain.jsonl"]["accepted"]) == (4, 4)
    assert by_name["b-truncated.jsonl.zst"]["duplicates"] == 1 and by_name["c-plain.jsonl"]["duplicates"] == 1
    for entry in by_name.values():
        assert len(entry["sha256"]) == 64


def test_rejects_file_names_shard_line_and_raw_bytes(bad_build):
    rejects = [json.loads(line) for line in (bad_build / "rejects.jsonl").read_text().splitlines()]
    assert {(r["shard"].rsplit("/", 1)[1], r["line"]): r["reason"] for r in rejects} == EXPECTED_REJECTS
    assert len(rejects) == len(EXPECTED_REJECTS)
    invalid = next(r for r in rejects if r["line"] == 4 and r["shard"].endswith("a-pile.jsonl.zst"))
    assert base64.b64decode(invalid["raw_base64"]) == b'{"text": "bad \xff\xfe bytes"}'
    truncated = next(r for r in rejects if r["reason"] == "truncated_stream")
    # The readable prefix ends half-way through line 4; that half line is the reject's raw bytes.
    assert base64.b64decode(truncated["raw_base64"]) == b'{"text": "This line is cut '


def test_truncated_file_keeps_its_readable_prefix(bad_build):
    from dp_helpers import read_jsonl_zst

    parsed = sorted((bad_build / "work" / "parsed").glob("b-truncated*"))[0]
    texts = [doc["text"] for doc in read_jsonl_zst(parsed / "docs.jsonl.zst")]
    assert texts == ["Truncated-file document one.", "Truncated-file document two.",
                     "A duplicated document with spacing."]


def test_missing_input_exits_nonzero_with_message(tmp_path, capsys):
    assert build(tmp_path / "out", [tmp_path / "nope.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "nope.jsonl" in err and "no such file" in err


def test_glob_matching_nothing_exits_nonzero(tmp_path, capsys):
    assert build(tmp_path / "out", [str(tmp_path / "*.jsonl.zst")]) == 2
    assert "matches nothing" in capsys.readouterr().err


def test_nothing_valid_exits_nonzero(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": ""}\n{"oops"\n')
    assert build(tmp_path / "out", [bad]) == 2
    assert "nothing valid remains for training: of 2 records read, 2 were rejected" in capsys.readouterr().err
    # Even then every reject is written down.
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects] == [(1, "empty_document"), (2, "malformed_json")]
