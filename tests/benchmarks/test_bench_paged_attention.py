"""benchmarks/bench_paged_attention.py: the pools it builds hold the exact width mix, and one CPU
cell runs both contenders and reports the paged op against its twin and the bytes each reads."""

import torch

from megatron_triroute.training.recipes import get_recipe
from tests.benchmarks import load_benchmark


def test_pools_hold_the_exact_mix_and_a_cell_reports_both_contenders():
    bench = load_benchmark("bench_paged_attention")
    owner = bench.exact_owner(10, [0.5, 0.3, 0.2, 0.0], torch.Generator().manual_seed(0))
    assert torch.bincount(owner, minlength=4).tolist() == [5, 3, 2, 0]
    shape = get_recipe("tiny").triroute.validate()
    row = bench.cell(shape, 2, 40, [0.25, 0.25, 0.25, 0.25], 0.5, 1, 1, torch.device("cpu"), 1e9, per_pool_too=True)
    m = shape.model
    assert row["max_abs_diff_vs_torch_twin"] < 1e-5
    assert row["dense"]["kv_bytes"] == 2 * 2 * m.n_kv_heads * 40 * m.d_head * 4  # K and V, float32 on the CPU
    assert 0 < row["paged"]["kv_bytes"] < row["dense"]["kv_bytes"]
    assert {"paged", "dense", "per_pool"} <= row.keys() and row["paged"]["s"]["median"] > 0
