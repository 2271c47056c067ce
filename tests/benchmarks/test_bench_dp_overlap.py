"""benchmarks/bench_dp_overlap.py at a tiny size: its JSON is well formed and its figures are
consistent with what it measured (no speed targets: on a shared 2-core CPU those are not stable)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_dp_overlap.py"
TINY = ["triroute.model.n_layers=2", "triroute.model.seq_len=32", "triroute.model.d_model=64",
        "triroute.model.d_ff=128", "triroute.router.d_router=32", "triroute.model.n_kv_heads=2"]

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def result():
    cmd = [sys.executable, str(PATH), "--nprocs", "2", "--warmup", "1", "--repeats", "1", "--rounds", "1", "--micro-batch", "1",
           "--bucket-mb", "0.05", "--json", *TINY]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_the_default_is_measured_against_its_no_overlap_baseline(result):
    per = result["worlds"]["2"]
    assert sorted(per) == ["default", "no_overlap"]
    base = per["no_overlap"]
    for name, row in per.items():
        assert row["baseline"] == "no_overlap", name
        assert row["step_s"] > 0 and row["peak_rss_mib"] > 0 and row["comm_s_per_step"] > 0, name
        assert row["step_ratio"] == pytest.approx(row["step_s"] / base["step_s"])
        assert row["peak_rss_ratio"] == pytest.approx(row["peak_rss_mib"] / base["peak_rss_mib"])
        assert 0.0 <= row["hidden_fraction"] <= 1.0
        assert row["exposed_comm_s_per_step"] == pytest.approx(
            row["comm_s_per_step"] * (1 - row["hidden_fraction"]), rel=1e-6, abs=1e-9)
        assert row["params"] == base["params"]


def test_only_the_overlapped_engine_communicates_during_backward(result):
    per = result["worlds"]["2"]
    # communication launched after the schedule returned hides nothing, by the measurement's definition
    assert per["no_overlap"]["hidden_fraction"] == 0.0 and per["no_overlap"]["dense_buckets"] == 1
    assert per["default"]["dense_buckets"] > 1 and per["default"]["hidden_fraction"] > 0.0


def _report(results, rank):
    results.put((rank, {"rank": rank}))


def _die(results, rank):
    import os

    os._exit(3)


def test_a_rank_that_dies_without_a_report_fails_the_group_at_once():
    import importlib.util
    import multiprocessing

    spec = importlib.util.spec_from_file_location("bench_dp_overlap", PATH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ctx = multiprocessing.get_context("spawn")

    def group(*targets):
        results = ctx.SimpleQueue()
        procs = [ctx.Process(target=t, args=(results, r)) for r, t in enumerate(targets)]
        for p in procs:
            p.start()
        return results, procs

    assert bench._collect(*group(_report, _report), "default", 2) == {0: {"rank": 0}, 1: {"rank": 1}}
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] exited without a report \(exit codes \[(0|None), 3\]\)"):
        bench._collect(*group(_report, _die), "default", 2, timeout_s=120)
