"""benchmarks/bench_export_memory.py: its figures are consistent with what it measured and wrote (no
memory targets here: those live in the benchmark's printed output). `--quick --json` exports the
tiny recipe's shape three times and measures a baseline interpreter, in under a minute."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tests.benchmarks import load_benchmark

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_export_memory.py"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_export_memory")


@pytest.fixture(scope="module")
def quick(tiny_data, tmp_path_factory):
    """The CLI's --quick --json output (progress and the table go to stderr, the object to stdout)."""
    work = tmp_path_factory.mktemp("bench_export_memory")
    run = subprocess.run([sys.executable, str(PATH), "--quick", "--json", "--data", str(tiny_data),
                          "--workdir", str(work)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ratio = (peak RSS - baseline) / model bytes" in run.stderr  # the table
    assert list(work.iterdir()) == []  # the scratch directory is removed
    return json.loads(run.stdout)


def test_quick_json_fields_are_computed_from_the_measurements(quick):
    from megatron_triroute.training.recipes import dense_parameter_count, get_recipe

    assert quick["quick"] and quick["recipe"] == "tiny"
    shape = get_recipe("tiny").triroute.model
    assert quick["shape"]["d_model"] == shape.d_model and quick["shape"]["n_layers"] == shape.n_layers
    assert quick["parameters"] > dense_parameter_count(get_recipe("tiny").triroute) * 0.5
    model, baseline = quick["model_bytes"], quick["baseline_rss_bytes"]
    m = quick["shape"]  # the query weights split from the fused QKV: n_layers x H x d_head x D at fp32
    d_head = m["d_model"] // m["n_heads"]
    assert quick["query_split_bytes"] == m["n_layers"] * m["n_heads"] * d_head * m["d_model"] * 4
    assert model >= 4 * quick["parameters"]  # fp32 parameters, plus buffers
    assert quick["baseline_import_failures"] == []
    assert "megatron_triroute.export.exporter" in quick["baseline_modules"]
    rows = {r["name"]: r for r in quick["runs"]}
    assert set(rows) == {"fp32_sharded", "bf16_sharded", "fp32_one_file"}
    for row in rows.values():
        assert row["peak_rss_bytes"] > 0 and baseline > 0
        assert row["ratio"] == pytest.approx((row["peak_rss_bytes"] - baseline) / model)
        held = min(row["largest_shard_bytes"], model) + quick["query_split_bytes"]
        assert row["bound"] == pytest.approx(1 + held / model)
        assert row["within_bound"] == (row["ratio"] <= row["bound"])
        assert row["largest_shard_bytes"] <= row["exported_tensor_bytes"]
    assert quick["max_ratio"] == max(r["ratio"] for r in rows.values())
    assert quick["sharded_fp32_ratio"] == rows["fp32_sharded"]["ratio"]
    # At fp32 the export writes every model tensor of the checkpoint once, the training-only budget
    # buffers excepted; bf16 halves the parameters only (buffers keep their dtypes).
    for name in ("fp32_sharded", "fp32_one_file"):
        assert rows[name]["exported_tensor_bytes"] == model - quick["training_only_bytes"]
    bf16 = rows["bf16_sharded"]["exported_tensor_bytes"]
    assert model / 2 <= bf16 < model / 2 + model / 20
    # Several shards with --max-shard-size = model bytes / --shards, one file with the default.
    limit = math.ceil(model / quick["shards_requested"])
    assert rows["fp32_sharded"]["max_shard_size"] == rows["bf16_sharded"]["max_shard_size"] == str(limit)
    assert rows["fp32_sharded"]["shards"] >= quick["shards_requested"] > 1
    assert 1 < rows["bf16_sharded"]["shards"] <= rows["fp32_sharded"]["shards"]
    assert rows["fp32_one_file"]["shards"] == 1
    assert rows["fp32_sharded"]["exported_tensors"] == rows["bf16_sharded"]["exported_tensors"] \
        == rows["fp32_one_file"]["exported_tensors"]


def test_exported_bytes_are_read_from_safetensors_headers(bench, tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16)}, str(tmp_path / "x.safetensors"),
              metadata={"format": "pt"})
    assert bench.exported_tensors(tmp_path) == {"x.safetensors": {"a": 60, "b": 14}}


def test_top_level_imports_parse_importtime_nesting(bench):
    err = "\n".join(["import time: self [us] | cumulative | imported package",
                     "import time:        10 |         10 |     _io",
                     "import time:        20 |         30 |   io",
                     "import time:        40 |         70 | torch",
                     "[export] reading ckpt",
                     "import time:         5 |          5 |   torch.x",
                     "import time:         5 |         10 | megatron_triroute.export.exporter",
                     "import time:         5 |         10 | torch"])
    assert bench.top_level_imports(err) == ["torch", "megatron_triroute.export.exporter"]


def test_peak_rss_is_the_child_own(bench):
    """A child that allocates ~200 MiB reports at least that, and a bare one far less: the launcher
    keeps the measuring process's own size out of the figure."""
    env = bench.child_env()
    code = "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096])"
    _, big, _, _ = bench.run_measured([sys.executable, "-c", code], env)
    rc, small, _, _ = bench.run_measured([sys.executable, "-S", "-c", "pass"], env)
    assert rc == 0
    assert big >= 200 * 2**20 and small < 100 * 2**20
