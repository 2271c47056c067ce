"""benchmarks/bench_train_step.py: its counters against hand counts, and one in-process run at a
tiny size whose JSON carries the ratios (no speed targets: on a shared 2-core CPU those are not
stable)."""


import pytest
import torch
import torch.nn.functional as F

from megatron_triroute.model.attention import routed_attention
from tests.benchmarks import load_benchmark

TINY = ["triroute.model.n_layers=1", "triroute.model.seq_len=32", "triroute.model.d_model=64",
        "triroute.model.d_ff=128", "triroute.router.d_router=16", "triroute.model.vocab_size=256",
        "triroute.router.window=8"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_train_step")


def test_attention_flops_hand_counts(bench):
    """4 d per (query head, key) pair: the causal triangle under is_causal, the whole rectangle
    under a mask; GQA counts query heads."""
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8)
    with bench.AttentionFlops() as counter:
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        F.scaled_dot_product_attention(q, k, k, attn_mask=torch.ones(10, 10, dtype=torch.bool), enable_gqa=True)
    assert counter.calls == 2
    assert counter.flops == 4 * 8 * 2 * 4 * (10 * 11 // 2 + 10 * 10)


def test_relaxed_attention_flops_are_full_plus_the_local_blocks(bench):
    """The relaxed path's attention runs the causal full attention once and the local mode over
    blocks of b queries x (b + w) keys: at T = 64, w = 8, b = 16, 4 blocks x 16 x 24 pairs."""
    from megatron_triroute.model.mode_attention import LOCAL_QUERY_BLOCK

    B, T, H, H_kv, d, w = 1, 64, 4, 2, 8, 8
    q, k = torch.randn(B, T, H, d), torch.randn(B, T, H_kv, d)
    modes = torch.rand(B, T, H, 3, requires_grad=True)
    with bench.AttentionFlops() as counter:
        routed_attention(q, k, k, modes, w)
    b = LOCAL_QUERY_BLOCK
    assert counter.flops == 4 * d * B * H * (T * (T + 1) // 2 + (T // b) * b * (b + w))


def test_flex_attention_flops_count_the_blocks_its_mask_runs(bench):
    """FlexAttention computes every 128 x 128 block its mask leaves in: the local window w = 16 over
    T = 300 keeps 1 + 2 + 2 blocks (the diagonal, and the one before it once there is one)."""
    from megatron_triroute.model.mode_attention import _flex_window_mask

    B, H, T, d = 2, 4, 300, 8
    assert bench.flex_flops(torch.randn(B, H, T, d), _flex_window_mask(T, 16, torch.device("cpu"))) == \
        4 * d * B * H * 5 * 128 * 128


def test_a_counted_flex_call_runs_outside_the_counter_and_counts_once(bench):
    """torch.compile refuses to run under a dispatch mode: the counted FlexAttention call steps out
    of the op counter, which counts it as one foreign op, and its FLOPs come from its mask."""
    from benchmarks.op_counter import StepCounter
    from megatron_triroute.model.mode_attention import flex_local_attention, local_attention

    counter, flops = StepCounter(), bench.AttentionFlops()
    q = torch.randn(1, 40, 2, 8)
    with torch.no_grad(), counter, flops:  # FlexAttention has no backward on a CPU
        out = bench.counted_flex(flex_local_attention, counter, flops)(q, q[:, :, :1], q[:, :, :1], 5)
    torch.testing.assert_close(out, local_attention(q, q[:, :, :1], q[:, :, :1], 5), rtol=1e-5, atol=1e-5)
    assert counter.foreign_ops == {"flex_attention": 1}
    assert flops.flops == 4 * 8 * 1 * 2 * 1 * 128 * 128 and flops.calls == 1


def test_tiny_run_reports_the_ratios(bench, capsys, tmp_path):
    result = bench.main(["--micro-batch", "1", "--warmup", "0", "--repeats", "2", "--json",
                         "--host-profile", str(tmp_path), *TINY])
    for key in ("ratio", "aten_ops_ratio", "attention_flops_ratio", "moved_bytes_ratio"):
        assert result[key] > 0, key
    assert set(result["host_syncs_per_step"]) == {"triroute", "dense"}
    # no op measured pathologically slow on a GPU (a CPU figure cannot show that cost)
    assert result["counts"]["triroute"]["gpu_slow_ops"] == {} == result["counts"]["dense"]["gpu_slow_ops"]
    # the same counts, from the per-model table
    counts = result["counts"]
    assert result["aten_ops_ratio"] == counts["triroute"]["aten_ops"] / counts["dense"]["aten_ops"]
    assert result["moved_bytes_ratio"] == counts["triroute"]["moved_bytes"] / counts["dense"]["moved_bytes"]
    # TriRoute's step moves more than Dense's (its controller, routing and local mode, on the same backbone)
    assert counts["triroute"]["moved_bytes"] > counts["dense"]["moved_bytes"] > 0
    # Dense reads full attention only; TriRoute adds the local blocks: T = 32, w = 8, b = 16
    assert result["attention_flops_ratio"] == pytest.approx(1 + (32 // 16) * 16 * 24 / (32 * 33 / 2))
    for spread in (result["ratio_per_step"], result["cpu_ratio_per_step"]):
        assert spread["q1"] <= spread["median"] <= spread["q3"]
    assert '"ratio"' in capsys.readouterr().out
    # the host profile names the step's own functions, and its time is a step's
    for name in ("triroute", "dense"):
        assert "train_step" in (tmp_path / f"{name}_host.txt").read_text()
        assert 0 < result["host_profile_s_per_step"][name] < 60


def test_profile_time_by_source_charges_our_frames_and_autograd_nodes(bench):
    """`by_source` charges an operator to the innermost enclosing frame of the package (here
    `scale_gradients`' multi-tensor multiply) and a backward operator to its autograd node."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_triroute.parallel.grad_reduce import scale_gradients

    x = torch.randn(256, 256, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        (x * 3).sum().backward()
        scale_gradients([x.grad], 0.5)
    table = bench.by_source(prof.events(), device_time=False)
    wheres = {where for where, _ in table}
    assert any(w.endswith("scale_gradients") and "megatron_triroute/parallel/grad_reduce.py(" in w for w in wheres)
    assert ("backward MulBackward0", "aten::mul") in table
    assert all(ms > 0 and calls > 0 for ms, calls in table.values())
    text = bench.format_sources(table)
    assert "ms in all" in text and "megatron_triroute/parallel/grad_reduce.py(" in text
