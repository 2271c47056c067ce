"""The matched-budget sweep command: its default plan and Slurm plan (dry runs at the defaults), and
a small real sweep trained, evaluated on the hard path and read off."""

import csv
import os
import subprocess
import sys

from tests.training.conftest import REPO, TINY_OVERRIDES


def sweep(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megatron_triroute.sweep", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_default_plan_covers_every_system_and_the_slurm_array_dry_runs(tiny_data, tmp_path):
    done = sweep("--data", str(tiny_data), "--output", str(tmp_path / "sweep"), "--dry-run")
    assert done.returncode == 0, done.stderr
    lines = [l for l in done.stdout.splitlines() if l.startswith("[sweep] point")]
    recipes = [l.split("--recipe ")[1].split()[0] for l in lines]
    # dense 1, MoD 3 capacities, MoE top-k 1..4, KV-quant 3 widths, Independent 2x1x2, TriRoute 3 target pairs
    assert [recipes.count(r) for r in ("tiny-dense", "tiny-mod", "tiny-moe", "tiny-kvquant", "tiny-independent",
                                       "tiny")] == [1, 3, 4, 3, 4, 3]
    done = sweep("--data", str(tiny_data), "--output", str(tmp_path / "sweep"), "--slurm")
    assert done.returncode == 0, done.stderr
    plan = (tmp_path / "sweep" / "sweep_plan.tsv").read_text().splitlines()
    assert len(plan) == 18 and "sbatch --array=0-17 slurm/sweep.sh" in done.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TRIROUTE_"))}
    env.update(REPO=str(REPO), TRIROUTE_DRY_RUN="1", OMP_NUM_THREADS="1", SLURM_JOB_ID="1", SLURM_ARRAY_TASK_ID="9",
               SLURM_JOB_NUM_NODES="1", SLURM_NTASKS_PER_NODE="1", PLAN=str(tmp_path / "sweep" / "sweep_plan.tsv"),
               DATA=str(tiny_data))
    job = subprocess.run(["bash", str(REPO / "slurm" / "sweep.sh")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert job.returncode == 0 and "dry run OK" in job.stdout, job.stdout[-2000:] + job.stderr[-2000:]
    assert "--recipe tiny-kvquant " in job.stdout and "triroute.router.uniform_bits=4" in job.stdout  # point 9: the second width


def test_a_small_sweep_trains_evaluates_and_reads_off_the_point_within_budget(tiny_data, tmp_path):
    out = tmp_path / "sweep"
    done = sweep("--data", str(tiny_data), "--output", str(out), "--systems", "kvquant",
                 "--grid", "kvquant:router.uniform_bits=4,8", "--flops-target", "1.0", "--mem-target", "0.4",
                 *TINY_OVERRIDES, "train.steps=2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {r["knobs"]: r for r in csv.DictReader(open(out / "points.csv"))}
    assert set(rows) == {"uniform_bits=4", "uniform_bits=8"}
    mem = {k: float(r["realised_mem"]) for k, r in rows.items()}
    # a uniform width stores b bits + a float16 scale and zero per group of the 16-bit dense token
    assert mem["uniform_bits=4"] < 0.4 < mem["uniform_bits=8"] < 1.0
    assert all(float(r["realised_flops"]) > 0.99 for r in rows.values())  # KV-quant saves memory only
    table = (out / "table2.md").read_text()
    assert "| kvquant | uniform_bits=4 |" in table  # the one point within both targets
    assert (out / "frontier_flops.png").stat().st_size > 0 and (out / "frontier_mem.png").stat().st_size > 0
    again = sweep("--data", str(tiny_data), "--output", str(out), "--systems", "kvquant",
                  "--grid", "kvquant:router.uniform_bits=4,8", "--flops-target", "1.0", "--mem-target", "0.4",
                  *TINY_OVERRIDES, "train.steps=2")
    assert again.returncode == 0 and again.stdout.count("finished earlier") == 2


def test_seeds_train_each_point_per_seed_two_at_a_time_and_average(tiny_data, tmp_path):
    out = tmp_path / "sweep"
    args = ["--data", str(tiny_data), "--output", str(out), "--systems", "kvquant", "--grid",
            "kvquant:router.uniform_bits=4", "--seeds", "3,5", "--jobs", "2", "--flops-target", "1.0",
            "--mem-target", "0.4", *TINY_OVERRIDES, "train.steps=2"]
    done = sweep(*args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = list(csv.DictReader(open(out / "points.csv")))
    assert sorted(r["seed"] for r in rows) == ["3", "5"]
    for seed in (3, 5):
        config = (out / "runs" / "kvquant" / "uniform_bits4" / f"seed{seed}" / "config.json").read_text()
        assert f'"seed": {seed}' in config
    ppl = sorted(float(r["valid_ppl"]) for r in rows)
    assert ppl[0] != ppl[1]  # another initialisation
    table = (out / "table2.md").read_text()
    line = next(l for l in table.splitlines() if l.startswith("| kvquant |"))
    assert "| 2 |" in line and f"{sum(ppl) / 2:.2f} ± {(ppl[1] - ppl[0]) / 2:.2f}" in line


def test_a_finished_point_is_reused_only_with_the_config_the_sweep_would_run(tmp_path, capsys):
    """A finished point (faked: its summary.json and the config.json the trainer writes, with the
    tokenizer's vocabulary) is reused when its config is the sweep's run for it; one trained with
    another override is refused with exit 2, naming the field and the fix."""
    import json

    from megatron_triroute import sweep as sweep_mod
    from megatron_triroute.evaluation.sweep import run_dir_for
    from megatron_triroute.training.recipes import resolve

    out, data = tmp_path / "sweep", tmp_path / "data"
    args = ["--data", str(data), "--output", str(out), "--systems", "kvquant", "--grid", "kvquant:router.uniform_bits=4",
            "--dry-run", *TINY_OVERRIDES, "train.steps=2"]
    point = run_dir_for(out, "kvquant", {"router.uniform_bits": 4})
    point.mkdir(parents=True)
    (point / "summary.json").write_text("{}")
    trained = resolve("tiny-kvquant", [*TINY_OVERRIDES, "train.steps=2", "triroute.router.uniform_bits=4",
                                       f"data.path={data}", f"output_dir={point}"])
    trained.triroute.model.vocab_size = 1024  # the trainer sets it from the data's tokenizer
    (point / "config.json").write_text(trained.to_json())
    assert sweep_mod.main(args) == 0, capsys.readouterr().err
    capsys.readouterr()

    trained.train.steps = 3
    trained.optim.eps = 1e-3
    (point / "config.json").write_text(trained.to_json())
    assert sweep_mod.main(args) == 2
    err = capsys.readouterr().err
    assert "optim.eps: trained with 0.001, the sweep now runs 1e-08" in err
    assert "train.steps: trained with 3, the sweep now runs 2" in err
    assert str(point) in err and "another --output" in err and f"delete {point}" in err
    assert json.loads((point / "config.json").read_text())["train"]["steps"] == 3  # nothing was touched

    (point / "config.json").unlink()
    assert sweep_mod.main(args) == 2
    assert "has no config.json" in capsys.readouterr().err
