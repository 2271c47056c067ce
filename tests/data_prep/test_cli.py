"""The shard/merge split of the CLI, as a Slurm array uses it."""

from __future__ import annotations

from dp_helpers import FIXTURES, build, summary

BAD = FIXTURES / "bad_inputs"


def test_merge_refuses_until_every_shard_is_parsed(tmp_path, capsys):
    out = tmp_path / "out"
    # 3 shards over 2 tasks: task 0 takes [0, 1) = a-pile, task 1 takes [1, 3) = b-truncated, c-plain.
    assert build(out, [BAD], "--task-index", "1", "--num-tasks", "2", command="shard") == 0
    assert sorted(p.name.split("-")[0] for p in (out / "work" / "parsed").iterdir()) == ["b", "c"]
    assert build(out, [BAD], "--vocab-size", "320", command="merge") == 2
    err = capsys.readouterr().err
    assert "1 of 3 shards have no finished parse" in err and "a-pile.jsonl.zst" in err
    assert build(out, [BAD], "--task-index", "0", "--num-tasks", "2", command="shard") == 0
    assert build(out, [BAD], "--vocab-size", "320", "--valid-fraction", "0.3", command="merge") == 0
    assert summary(out)["documents"]["read"] == 22


def test_invalid_option_names_the_value_and_fix(tmp_path, capsys):
    assert build(tmp_path / "out", [BAD], "--valid-fraction", "1.5") == 2
    err = capsys.readouterr().err
    assert "valid_fraction=1.5" in err and "Fix:" in err
