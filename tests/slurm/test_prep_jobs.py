"""The data-prep Slurm recipe (slurm/prep_pile.sh + slurm/common_prep.sh) on the one-node cluster:
a real 2-task job array whose first task submits the dependent merge job with the real sbatch, and
the merged outputs byte-identical to a single-process build of the same corpus. (The requeue and
argument checks with a recording sbatch stay in tests/data_prep/test_slurm_scripts.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}
# The recipes' #SBATCH lines ask for 8 CPUs and 32G per task, the merge for 32 CPUs: the node has 2.
CPU_FLAGS = ("--cpus-per-task=1", "--mem=1G", "--time=10")


def _jobs(cluster) -> dict[int, dict[str, str]]:
    """Every job the controller still lists (finished ones stay for MinJobAge), by job id; array
    tasks under '<array id>_<task>'."""
    text = cluster.run("squeue", "-h", "-t", "all", "-o", "%A|%F|%K|%j|%T").stdout
    out = {}
    for line in text.splitlines():
        job_id, array, index, name, state = line.split("|")
        out[int(job_id)] = {"array": array, "index": index, "name": name, "state": state}
    return out


def _wait(cluster, select, count: int, timeout: float) -> dict[int, str]:
    """Wait until `count` jobs match `select(info)` and all have ended; their states by job id."""
    deadline = time.monotonic() + timeout
    states: dict[int, str] = {}
    while time.monotonic() < deadline:
        states = {j: info["state"] for j, info in _jobs(cluster).items() if select(info)}
        if len(states) == count and all(s in FINAL for s in states.values()):
            return states
        time.sleep(1)
    raise AssertionError(f"jobs not finished after {timeout} s: {states}\n{cluster.logs()}")


def _logs(paths) -> str:
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in paths if p.exists())


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_pile_array_and_merge_jobs_on_the_cluster_match_a_single_build(slurm_cluster, tmp_path):
    from data_prep.corpus import CorpusConfig, build_corpus

    from tests.data_prep.dp_helpers import CORPUS_OPTIONS, build, output_bytes, summary

    corpus, reference, out = tmp_path / "corpus", tmp_path / "reference", tmp_path / "out"
    build_corpus(corpus, CorpusConfig(max_docs=60, shards=3))
    assert build(reference, [corpus], *CORPUS_OPTIONS) == 0

    env = dict(slurm_cluster.env, INPUT_GLOB=f"{corpus}/*.jsonl.zst", OUT_DIR=str(out), VOCAB_SIZE="400",
               VALID_FRACTION="0.2", LONG_CONTEXT_TOKENS="600", TOKENIZER_THREADS="4", PYTHON=sys.executable,
               MERGE_CPUS="1", MERGE_MEM="1G", MERGE_TIME="10")
    for name in ("REPO", "PREP_STAGE", "PREP_SUBMIT_MERGE", "WORKERS", "TOKENIZER"):
        env.pop(name, None)
    before = set(_jobs(slurm_cluster))
    done = subprocess.run(["sbatch", "--parsable", "--array=0-1", *CPU_FLAGS, f"--output={tmp_path}/prep-%A_%a.out",
                           str(REPO / "slurm" / "prep_pile.sh")], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    array_id = int(done.stdout.strip().split(";")[0])
    task_logs = [tmp_path / f"prep-{array_id}_{i}.out" for i in (0, 1)]
    merge_logs: list[Path] = []
    try:
        task_states = _wait(slurm_cluster, lambda info: info["array"] == str(array_id), 2, timeout=240)
        assert set(task_states.values()) == {"COMPLETED"}, (task_states, _logs(task_logs))
        tasks = sorted(task_states)

        merges = [j for j, info in _jobs(slurm_cluster).items()
                  if j not in before and info["name"] == "prep-pile-merge"]
        assert len(merges) == 1, (_jobs(slurm_cluster), _logs(task_logs))  # one merge, from task 0
        merge = merges[0]
        merge_logs.append(REPO / f"slurm-prep-pile-merge-{merge}.out")  # the recipe's --chdir=$REPO log
        state = slurm_cluster.wait_finished(merge, timeout=300)
        assert state == "COMPLETED", (state, _logs(merge_logs + task_logs))

        # The dependency held: the merge started only after both array tasks had ended.
        fields = {j: slurm_cluster.job_fields(j) for j in (*tasks, merge)}
        assert all(fields[merge]["StartTime"] >= fields[t]["EndTime"] for t in tasks), fields
        assert "prep-pile" == fields[tasks[0]]["JobName"]
        parsed = list((out / "work" / "parsed").rglob("*"))
        assert parsed, "the array tasks parsed nothing into work/parsed"

        produced = {k: v for k, v in output_bytes(out).items() if k != "summary.json"}
        expected = {k: v for k, v in output_bytes(reference).items() if k != "summary.json"}
        assert produced.keys() == expected.keys() and produced == expected
        assert summary(out)["documents"] == summary(reference)["documents"]
    finally:
        for log in merge_logs:
            log.unlink(missing_ok=True)
