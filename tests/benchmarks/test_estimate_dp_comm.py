"""benchmarks/estimate_dp_comm.py at its defaults (1p3b on 8 x 8 GPUs): every row recomputed by hand
from the parameter split and the layout it prints."""


import pytest
from tests.benchmarks import load_benchmark



def _module():
    return load_benchmark("estimate_dp_comm")


def test_defaults_rows_follow_the_ring_arithmetic(capsys):
    from megatron_triroute.training.planner import estimate_rank_memory
    from megatron_triroute.training.recipes import resolve

    module = _module()
    out = module.main([])
    printed = capsys.readouterr().out
    assert "recipe 1p3b: 8 nodes x 8 GPUs" in printed
    run = resolve("1p3b", [])
    run.validate(64)
    assert out["per_rank"] == estimate_rank_memory(run, 64)["parameters_per_rank"]
    assert out["dense"] + out["expert"] == pytest.approx(out["per_rank"])
    assert out["dense"] > 0 and out["expert"] > 0
    dp, edp = out["dp"], out["edp"]
    assert dp == 64 // (run.parallel.tensor * run.parallel.pipeline)
    ring = out["dense"] * (dp - 1) / dp + out["expert"] * (edp - 1) / edp
    bytes_per_param = {  # (gradients, parameters) bytes per parameter on the wire, before the ring factor
        "before: fp32 all-reduce + ZeRO-1 fp32 broadcasts": 2 * 4 + 4,
        "megatron DDP (retired): same, all-reduce overlapped": 2 * 4 + 4,
        "replicated, grad_reduce_dtype=bf16 (retired)": 2 * 2 + 4,
        "megatron_distopt, fp32 run (the engine): fp32 grads + params, overlap": 4 + 4,
        "dist. optimizer, fp32 grads, bf16 params, overlap": 4 + 2,
        "megatron_distopt, bf16 run (the engine): bf16 grads + params, overlap": 2 + 2,
    }
    assert set(out["rows"]) == set(bytes_per_param)
    for name, factor in bytes_per_param.items():
        row = out["rows"][name]
        assert row["bytes"] == pytest.approx(factor * ring, rel=1e-12), name
        for bandwidth in ("400 Gb/s", "3.2 Tb/s"):
            cell = row[bandwidth]
            assert 0 <= cell["exposed_s"] <= cell["comm_s"] + 1e-12, (name, bandwidth)
            assert cell["step_s"] == pytest.approx(out["compute_s"] + cell["exposed_s"])
    before, overlapped = out["rows"]["before: fp32 all-reduce + ZeRO-1 fp32 broadcasts"], \
        out["rows"]["megatron DDP (retired): same, all-reduce overlapped"]
    for bandwidth in ("400 Gb/s", "3.2 Tb/s"):
        assert before[bandwidth]["exposed_s"] == before[bandwidth]["comm_s"]  # nothing overlaps
        assert overlapped[bandwidth]["comm_s"] == pytest.approx(before[bandwidth]["comm_s"])
        assert overlapped[bandwidth]["exposed_s"] <= before[bandwidth]["exposed_s"]
    # 8x the bandwidth: an eighth of the communication time
    assert before["3.2 Tb/s"]["comm_s"] == pytest.approx(before["400 Gb/s"]["comm_s"] / 8)
