"""The chaos drill's own logic without a cluster: the fault plan, the corruption it injects, where it
expects a resume, and the targets it reports as missed (the drill itself runs in
tests/slurm/test_chaos_drill.py)."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

from megatron_triroute.checkpoint import save_checkpoint

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos_drill.py"
spec = importlib.util.spec_from_file_location("chaos_drill", PATH)
drill = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = drill  # dataclasses look their module up
spec.loader.exec_module(drill)


def test_fault_counts_spread_over_the_kinds():
    assert drill.fault_kinds(4) == ["kill_rank", "sigusr1", "kill_in_save", "corrupt"]
    ten = drill.fault_kinds(10)
    assert {k: ten.count(k) for k in drill.KINDS} == {
        "kill_rank": 2, "sigusr1": 2, "kill_in_save": 2, "corrupt": 2, "sigterm": 1, "save_crash": 1}
    with pytest.raises(drill.UsageError, match="unknown fault kind"):
        drill.fault_kinds(1, ["sigkill"])


@pytest.mark.parametrize("seed", range(30))
def test_between_attempt_faults_follow_a_failed_job(seed):
    kinds = drill.fault_kinds(10 + seed % 5)
    order = drill.order_faults(kinds, random.Random(seed))
    assert sorted(order) == sorted(kinds)
    for i, kind in enumerate(order):
        if kind == "corrupt":  # no attempt runs: the job before it failed
            assert i > 0 and order[i - 1] in drill.FAILING, order
        if kind == "save_crash":  # the hook rides on a submission by the drill, not on a requeue
            assert i == 0 or order[i - 1] in drill.FAILING | {"corrupt"}, order


def test_more_corruptions_than_failed_jobs_is_a_usage_error():
    with pytest.raises(drill.UsageError, match="corrupt faults need as many faults before them"):
        drill.order_faults(["sigusr1", "corrupt"], random.Random(0))


def save(root: Path, step: int, latest: bool = True) -> None:
    save_checkpoint(root, step, {"w": torch.full((64,), float(step))}, {"step": step})
    if not latest:  # published but never committed (a crash before `latest` moved)
        (root / "latest").write_text(f"step_{step - 4:08d}\n")


def test_corruption_needs_an_older_verified_checkpoint(tmp_path):
    save(tmp_path / "one", 4)
    assert drill.corrupt_newest(tmp_path / "one", random.Random(0)) == {}  # the only one: left alone
    assert drill.verified_steps(tmp_path / "one") == [4]
    methods = set()
    for seed in range(8):  # flips and truncations of the manifest's various files
        root = tmp_path / str(seed)
        save(root, 4)
        save(root, 8)
        detail = drill.corrupt_newest(root, random.Random(seed))
        assert (detail["step"], detail["fallback"]) == (8, 4)
        assert drill.verified_steps(root) == [4] and drill.expected_resume(root) == 4
        methods.add(detail["method"])
    assert methods == {"flip", "truncate"}


def test_expected_resume_ignores_an_uncommitted_newer_directory(tmp_path):
    assert drill.expected_resume(tmp_path) == 0
    save(tmp_path, 4)
    save(tmp_path, 8, latest=False)
    assert drill.verified_steps(tmp_path) == [4, 8]
    assert drill.expected_resume(tmp_path) == 4


def test_every_missed_target_is_reported():
    report = drill.Report(seed=0, steps=24, save_every=4, faults_requested=2, completed=True, max_param_diff=0.0)
    report.faults = [drill.Fault("kill_rank", survived=True), drill.Fault("corrupt", problem="resumed from step 0")]
    assert report.missed() == ["fault 1 (corrupt) not survived: resumed from step 0"]
    report.faults[1].survived, report.faults[1].problem = True, ""
    assert report.missed() == []
    report.max_param_diff, report.lost = 2e-6, ["step_00000008 (missing)"]
    report.completed, report.faults = False, report.faults[:1]
    assert report.missed() == ["1 faults injected, 2 requested", "1 checkpoint(s) lost: step_00000008 (missing)",
                               "the run did not complete", "final parameters differ by 2e-06 > 1e-06"]
    assert report.to_dict()["faults_survived"] == {"kill_rank": 1}
