"""The sweep's plan and point bookkeeping (evaluation/sweep.py), in process; the command end to end
is tests/test_sweep.py."""

from pathlib import Path

import pytest

from megatron_triroute.config import ConfigError
from megatron_triroute.evaluation.sweep import PlannedPoint, Sweep, plan_points, stale_fields, write_slurm_plan
from megatron_triroute.training.recipes import resolve


def test_points_run_system_by_system_each_setting_once_per_seed_and_the_slurm_lines_name_them(tmp_path):
    base = resolve("tiny", []).triroute
    planned = plan_points(["kvquant", "triroute"], {"kvquant": {"router.uniform_bits": [4]}}, [1, 2], base, 0.5, 0.45)
    pairs = [{"budget.flops_target": f, "budget.mem_target": m} for f, m in ((0.4, 0.35), (0.5, 0.45), (0.6, 0.55))]
    assert planned == [PlannedPoint("kvquant", {"router.uniform_bits": 4}, 1),
                       PlannedPoint("kvquant", {"router.uniform_bits": 4}, 2),
                       *(PlannedPoint("triroute", pair, seed) for pair in pairs for seed in (1, 2))]
    sweep = Sweep("tiny", Path("data/tiny"), tmp_path / "out", ["train.steps=2"])
    lines = write_slurm_plan(sweep, planned).read_text().splitlines()
    assert lines[1] == (f"tiny-kvquant\t{tmp_path}/out/runs/kvquant/uniform_bits4/seed2\t"
                        "train.steps=2 triroute.router.uniform_bits=4 triroute.seed=2")
    assert lines[6] == (f"tiny\t{tmp_path}/out/runs/triroute/flops_target0.6_mem_target0.55/seed1\t"
                        "train.steps=2 triroute.budget.flops_target=0.6 triroute.budget.mem_target=0.55 triroute.seed=1")
    with pytest.raises(ConfigError, match="unknown system 'kvqant'. Fix: use some of dense, mod"):
        plan_points(["kvqant"], {}, [None], base, 0.5, 0.45)


def test_a_finished_point_differs_only_in_fields_that_change_the_run(tmp_path):
    (tmp_path / "data").mkdir()
    saved = {"data": {"path": str(tmp_path / "data")}, "output_dir": "a", "parallel": {"tensor": 2},
             "train": {"steps": 3}}
    wanted = {"data": {"path": str(tmp_path / "data" / ".." / "data")}, "output_dir": "b", "parallel": {"tensor": 1},
              "train": {"steps": 2}}
    assert stale_fields(saved, wanted) == ["train.steps: trained with 3, the sweep now runs 2"]
