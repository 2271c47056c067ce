"""The Slurm recipes drive the real CLI: array tasks as plain processes with Slurm's variables set,
`sbatch` replaced by a recorder (no cluster needed), then the merge stage. The same recipe runs as a
real job array with its real merge job in tests/slurm/test_prep_jobs.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dp_helpers import FIXTURES, REPO, output_bytes, summary


def _fake_sbatch(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sbatch.log"
    script = bin_dir / "sbatch"
    script.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" >> {log}\necho ---- >> {log}\necho 4242\n')
    script.chmod(0o755)
    return bin_dir, log


def _run(script, env, tmp_path):
    full = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    result = subprocess.run(["bash", str(REPO / "slurm" / script)], env=full, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.parametrize("script", ["prep_pile.sh", "prep_redpajama.sh"])
def test_scripts_parse_and_declare_an_array(script):
    text = (REPO / "slurm" / script).read_text()
    assert "#SBATCH --array=" in text and "set -euo pipefail" in text
    assert subprocess.run(["bash", "-n", str(REPO / "slurm" / script)]).returncode == 0


def test_pile_array_then_merge_matches_a_single_build(tmp_path, small_corpus, corpus_reference):
    bin_dir, log = _fake_sbatch(tmp_path)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "INPUT_GLOB": f"{small_corpus}/*.jsonl.zst",
           "OUT_DIR": str(tmp_path / "out"), "VOCAB_SIZE": "400", "VALID_FRACTION": "0.2",
           "LONG_CONTEXT_TOKENS": "600", "TOKENIZER_THREADS": "4", "REPO": str(REPO),
           "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_COUNT": "2",
           "SLURM_CPUS_PER_TASK": "1"}
    for task_id in ("3", "4", "3"):  # the last one is a requeued first task
        _run("prep_pile.sh", {**env, "SLURM_ARRAY_TASK_ID": task_id}, tmp_path)
    submissions = log.read_text().split("----\n")[:-1]
    assert len(submissions) == 1  # one merge job, even after the requeue
    assert "--dependency=afterok:77" in submissions[0].splitlines()
    assert "PREP_STAGE=merge" in submissions[0]
    _run("prep_pile.sh", {**env, "PREP_STAGE": "merge", "WORKERS": "2"}, tmp_path)
    produced = {k: v for k, v in output_bytes(tmp_path / "out").items() if k != "summary.json"}
    expected = {k: v for k, v in output_bytes(corpus_reference).items() if k != "summary.json"}
    assert produced == expected


def test_redpajama_script_with_a_given_tokenizer(tmp_path, corpus_reference):
    env = {"INPUT_GLOB": f"{FIXTURES / 'formats'}/*.parquet {FIXTURES / 'formats'}/*.jsonl",
           "OUT_DIR": str(tmp_path / "out"), "PREP_SUBMIT_MERGE": "0", "REPO": str(REPO),
           "TOKENIZER": str(corpus_reference / "tokenizer/tokenizer.model"), "VALID_FRACTION": "0.3"}
    _run("prep_redpajama.sh", env, tmp_path)
    _run("prep_redpajama.sh", {**env, "PREP_STAGE": "merge"}, tmp_path)
    result = summary(tmp_path / "out")
    assert result["documents"]["read"] == 3  # two parquet rows + the mislabelled gzip line
    assert result["tokenizer"]["trained"] is False


def _array_shape(script: str) -> tuple[int, int]:
    """(first task id, task count) of the script's own `#SBATCH --array=LO-HI[%LIMIT]`."""
    import re

    spec = re.search(r"^#SBATCH --array=(\d+)-(\d+)", (REPO / "slurm" / script).read_text(), flags=re.M)
    lo, hi = int(spec.group(1)), int(spec.group(2))
    return lo, hi - lo + 1


@pytest.mark.parametrize("script,shards", [("prep_pile.sh", 30), ("prep_redpajama.sh", 10)])
def test_prep_arrays_start_at_their_own_array_shape(script, shards, tmp_path):
    """The default array (e.g. 30 tasks for the Pile's 30 train shards) partitions the shards exactly,
    and its first, a middle and its last task run the real script with Slurm's array variables."""
    from data_prep.inputs import task_range

    lo, count = _array_shape(script)
    covered = [i for t in range(count) for i in task_range(shards, t, count)]
    assert covered == list(range(shards))  # every shard once, in order, whatever the task count
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(shards):
        (inputs / f"{i:02d}.jsonl").write_text(f'{{"text": "document {i} of the default-shape check."}}\n')
    out = tmp_path / "out"
    for task in sorted({0, count // 2, count - 1}):
        env = {"INPUT_GLOB": str(inputs / "*.jsonl"), "OUT_DIR": str(out), "PREP_SUBMIT_MERGE": "0",
               "SLURM_ARRAY_TASK_ID": str(lo + task), "SLURM_ARRAY_TASK_MIN": str(lo),
               "SLURM_ARRAY_TASK_COUNT": str(count), "WORKERS": "1"}
        result = _run(script, env, tmp_path)
        assert f"shard task {task} of {count}" in result.stderr
    parsed = sorted(p.name for p in (out / "work").rglob("*") if p.is_file())
    assert parsed, "the tasks parsed nothing"
