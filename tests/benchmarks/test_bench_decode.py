"""benchmarks/bench_decode.py: its figures are computed from its measurements (no speed targets
here: those live in the benchmark's printed output). `--quick --json` runs in seconds; the Dense
baseline decodes like a full causal forward; MAC, KV-byte and roofline byte counts agree with hand
computations."""

import contextlib
import dataclasses
import io
import json
import math
import statistics

import pytest
import torch
import torch.nn.functional as F

from megatron_triroute.routing.quant import kv_bits_per_token
from megatron_triroute.systems import system_config
from megatron_triroute.training.recipes import get_recipe
from tests.benchmarks import load_benchmark
from triroute_kernels import cpu_ops_available



@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_decode")


@pytest.fixture(scope="module")
def quick(bench):
    """The CLI's --quick --json run, in this process (progress goes to stderr, the object to stdout)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = bench.main(["--quick", "--json"])
    assert "SYNTHETIC" in err.getvalue()  # the synthetic shape says so
    assert json.loads(out.getvalue()) == json.loads(json.dumps(result))
    return json.loads(out.getvalue())


def test_quick_json_fields_are_computed_from_the_measurements(bench, quick):
    rows = quick["synthetic"]
    assert set(rows) == {f"ctx{c}_b{b}" for c in quick["contexts"] for b in quick["batches"]}
    for key, row in rows.items():
        batch = int(key.split("_b")[1])
        dense = row["dense"]
        peaks = row["peaks"]
        assert peaks["bandwidth_gb_s"] > 0 and peaks["peak_gflops"] > 0
        assert (peaks["core_gflops"] is not None) == cpu_ops_available()
        for name in ("dense", *bench.ROUTED):
            r = row[name]
            runs = r["step_s_runs"]
            assert len(runs) == quick["repeats"]
            assert r["step_s"] == bench.spread(runs) and r["step_s"]["q1"] <= r["step_s"]["median"] <= r["step_s"]["q3"]
            assert r["tokens_per_s"] == pytest.approx(batch / statistics.median(runs))
            assert r["roofline_efficiency"] == pytest.approx(r["roofline_s"] / r["step_s"]["median"])
            if peaks["core_gflops"] is None:
                assert r["roofline_s_core"] is None and r["roofline_efficiency_core"] is None
            else:  # the same parts priced at the core's peak: cheaper compute, never a longer roofline
                assert r["roofline_efficiency_core"] == pytest.approx(r["roofline_s_core"] / r["step_s"]["median"])
                if peaks["core_gflops"] >= peaks["peak_gflops"]:
                    assert r["roofline_s_core"] <= r["roofline_s"] * (1 + 1e-12)
                else:
                    assert r["roofline_s_core"] >= r["roofline_s"] * (1 - 1e-12)
            assert r["executed_over_audited_attn"] == pytest.approx(r["executed_attn_macs"] / r["audited_attn_macs"])
            assert r["kv_resident_over_used"] == pytest.approx(r["kv_resident_bytes"] / r["kv_used_bytes"])
            assert r["kv_resident_bytes"] >= r["kv_used_bytes"] > 0
            assert r["ops_per_layer"] > 0
            # The counter cannot see inside the kernels; their work is in their own counters (the
            # expert gates' top-k of a few options has none worth counting).
            assert set(r["uncounted_ops"]) <= ({"triroute.paged_attention", "triroute.cache_append",
                                                "triroute.routed_experts", "triroute.controller_logits",
                                                "triroute.decode_qkv", "triroute.rms_norm", "triroute.decode_decisions",
                                                "triroute.decode_layer", "triroute.decode_layers",
                                                "triroute.top_k_gates"}
                                               if name != "dense" else {"triroute.rms_norm"})
        assert dense["host_syncs_per_step"] == 0
        assert dense["executed_over_audited_attn"] == 1.0  # SDPA over exactly the t + 1 keys
        for name in bench.ROUTED:
            r = row[name]
            assert r["speedup_vs_dense"] == pytest.approx(r["tokens_per_s"] / dense["tokens_per_s"])
            assert r["step_time_ratio"] == pytest.approx(r["step_s"]["median"] / dense["step_s"]["median"])
            assert r["limit"] == r["limit_macs"] == pytest.approx(dense["macs_per_token"] / r["macs_per_token"])
            assert r["limit_bytes"] == pytest.approx(dense["bytes_per_step"] / r["bytes_per_step"])
            assert r["efficiency"] == pytest.approx(r["speedup_vs_dense"] / r["limit"])
            assert r["kv_bytes_ratio"] == pytest.approx(r["kv_bytes_per_token"] / (2 * 2 * quick_d_kv(quick)))
            assert r["cost_audit_rel_err"] < 1e-9  # the audit counts exactly hard_cost's MACs
            if name in ("triroute", "kvquant"):  # the static decode step: no host read inside it
                assert r["host_syncs_per_step"] == 0 and r["ops_per_layer"] <= 120
            assert r["scheduler_ops_per_step"] > 0 and r["scheduler_host_reads_per_step"] >= 0
            assert r["executed_attn_macs"] >= r["audited_attn_macs"]  # page granularity at least
        if batch == max(quick["batches"]):  # the forced mix realises the budget (few decisions: rounding)
            assert row["triroute"]["realised"]["flops"] == pytest.approx(0.55, abs=0.03)
            assert row["triroute"]["realised"]["mem"] == pytest.approx(0.40, abs=0.03)
    ctx, (b1, b8) = quick["headline_context"], (min(quick["batches"]), max(quick["batches"]))
    assert ctx == max(quick["contexts"])  # the quick context is below 2,048
    for suffix, b in (("", b1), ("_b8", b8)):
        r = rows[f"ctx{ctx}_b{b}"]["triroute"]
        for key in ("speedup_vs_dense", "limit", "efficiency", "ffn_weight_read_ratio", "roofline_efficiency",
                    "roofline_efficiency_core"):
            assert quick[key + suffix] == r[key]
    r = rows[f"ctx{ctx}_b{b1}"]["triroute"]
    assert quick["step_time_ratio_b1"] == r["step_time_ratio"]
    for key in ("kv_bytes_ratio", "ops_per_layer", "host_syncs_per_step", "executed_over_audited_attn",
                "kv_resident_over_used"):
        assert quick[key] == r[key]
    assert quick["cost_audit_max_rel_err"] == max(r["cost_audit_rel_err"] for row in rows.values()
                                                  for n, r in row.items() if n in bench.ROUTED)


def quick_d_kv(quick) -> int:
    """L d_kv of the quick run's shape (KV bytes per token of a 16-bit cache = 2 * 2 * L d_kv)."""
    m = get_recipe(quick["synthetic_shape"]).triroute.validate().model
    return m.n_layers * m.d_kv


def test_macs_kv_bytes_and_roofline_bytes_match_hand_counts(bench):
    """KV-quant-only executes what Dense does (all heads full, dense FFN) plus its controller, stores
    every token at its uniform width, and a step must read every stored K/V byte of its context:
    checked against the Dense decoder's own count and kv_bits_per_token."""
    from megatron_triroute.inference.audit import CostAudit

    torch.set_grad_enabled(False)
    try:
        tiny = get_recipe("tiny").triroute
        tiny = dataclasses.replace(tiny, model=dataclasses.replace(tiny.model, n_kv_heads=2))  # GQA groups of 2
        cfg = system_config("kvquant", tiny.validate())
        m, r = cfg.model, cfg.router
        model = bench.build_routed(cfg)
        batch, context = 2, 20
        run = bench.RoutedRunner(model, context, batch, bench.budget_mix(cfg, context), steps=2, repeats=2)
        run.step()
        audit = CostAudit(m.n_layers)
        run.step(audit)
        t = context + 1  # the audited step's position
        dense = bench.DenseDecoder(m, batch, context + 4)
        controller = sum(layer.controller_macs for layer in model.layers)
        assert audit_per_token(bench, audit) == pytest.approx(dense.macs_per_token(t) + controller)
        assert run.kv_bytes_per_token * 8 == m.n_layers * kv_bits_per_token(r.uniform_bits, m.d_kv, r.group_size_for(m))
        parts = bench.routed_roofline_parts(run, audit, t)
        kv_parts = parts[1:-1:2]  # per layer: weights, then attention; the LM head last
        assert len(kv_parts) == m.n_layers
        for kv_bytes, flops in kv_parts:
            assert kv_bytes * 8 == pytest.approx(batch * (t + 1) * kv_bits_per_token(r.uniform_bits, m.d_kv, r.group_size_for(m)))
            assert flops == 2 * batch * 2 * m.d_head * m.n_heads * (t + 1)
    finally:
        torch.set_grad_enabled(True)


def audit_per_token(bench, audit) -> float:
    return bench.audit_macs(audit) / audit.tokens


def test_dense_decoder_equals_a_full_causal_forward(bench):
    """Step-by-step decode of the Dense baseline against a full-sequence forward written out here
    (explicit causal softmax; the cache keeps float32 K/V, the compute dtype: nothing is rounded)."""
    m = get_recipe("tiny").triroute.validate().model
    dec = bench.DenseDecoder(m, batch=1, max_len=8)
    tokens = torch.tensor([5, 17, 3, 99, 42, 7])
    steps = torch.stack([dec.step(t.view(1)) for t in tokens])[:, 0]  # (T, V)
    T, H, Hk, d = tokens.numel(), m.n_heads, m.n_kv_heads, m.d_head
    pos = torch.arange(T).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(pos, inv)] * 2, -1)  # (T, d)

    def rot(x):  # (T, heads, d)
        x1, x2 = x.chunk(2, -1)
        return x * emb.cos()[:, None] + torch.cat([-x2, x1], -1) * emb.sin()[:, None]

    with torch.no_grad():
        x = dec.emb[tokens]
        for i in range(m.n_layers):
            h = F.rms_norm(x, (m.d_model,), eps=1e-5)
            q = rot((h @ dec.wq[i].T).view(T, H, d))
            k, v = (h @ dec.wkv[i].T).view(T, 2, Hk, d).unbind(1)
            k = rot(k)
            k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
            s = torch.einsum("thd,uhd->htu", q, k) / math.sqrt(d)
            s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
            o = torch.einsum("htu,uhd->thd", s.softmax(-1), v).reshape(T, H * d)
            x = x + o @ dec.wo[i].T
            h = F.rms_norm(x, (m.d_model,), eps=1e-5)
            gate, up = (h @ dec.fc1[i].T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ dec.fc2[i].T
        want = F.rms_norm(x, (m.d_model,), eps=1e-5) @ dec.head.T
    assert (steps - want).abs().max() < 1e-4


def test_budget_dial_times_one_triroute_per_target_beside_dense(bench):
    """`--budgets`: one more TriRoute per (FLOPs, memory) target in every interleaved cell; the dial's
    figures are that system's row's, and the forced mixes realise their targets in order."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = bench.main(["--quick", "--json", "--systems", "triroute", "--budgets", "0.5,0.3", "1,1"])
    dial = result["budget_dial"]
    assert [(d["flops_target"], d["mem_target"], d["system"]) for d in dial] == [
        (0.5, 0.3, "triroute@0.5,0.3"), (1.0, 1.0, "triroute@1,1")]
    for d in dial:
        assert set(d["cells"]) == set(result["synthetic"])
        for key, cell in d["cells"].items():
            row = result["synthetic"][key]
            r = row[d["system"]]
            assert len(r["step_s_runs"]) == len(row["dense"]["step_s_runs"]) == result["repeats"]  # same rounds
            assert cell["speedup_vs_dense"] == pytest.approx(r["tokens_per_s"] / row["dense"]["tokens_per_s"])
            assert cell["step_time_ratio"] == bench.spread([a / b for a, b in zip(r["step_s_runs"],
                                                                                   row["dense"]["step_s_runs"])])
            assert cell["realised"] == r["realised"]
    for key in result["synthetic"]:  # full attention, no null route, every token at 16 bits: the dense costs
        full = dial[1]["cells"][key]
        assert full["realised"] == {"flops": pytest.approx(1.0), "mem": pytest.approx(1.0)}
        assert full["kv_bytes_ratio"] == pytest.approx(1.0)
        low = dial[0]["cells"][key]["realised"]
        assert low["flops"] < 0.75 and low["mem"] < 0.5  # a cheaper target is cheaper
    b8 = f"ctx{result['contexts'][0]}_b{max(result['batches'])}"
    assert dial[0]["cells"][b8]["realised"]["mem"] == pytest.approx(0.3, abs=0.03)
    assert "dial (0.5, 0.3):" in err.getvalue()


@pytest.mark.parametrize("budgets", [["0.5"], ["0,0.3"], ["1.5,0.3"], ["a,b"]])
def test_budget_dial_refuses_what_is_not_a_pair_of_fractions(bench, budgets, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--budgets", *budgets])
    assert "--budgets" in capsys.readouterr().err


def test_device_cuda_is_refused_where_no_gpu_is_visible(bench, capsys):
    if torch.cuda.is_available():
        assert bench.parse_args(["--quick", "--device", "cuda"]).device == "cuda"
        return
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--device", "cuda"])
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_quick_cells_on_cuda_time_synchronised_steps_that_read_nothing_back(bench):
    """`--device cuda`: Dense and TriRoute on the GPU, the engine's decode step with no host read,
    the forced mix realising the budget there as on the CPU."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        result = bench.main(["--quick", "--json", "--device", "cuda", "--systems", "triroute"])
    assert result["device"] == "cuda"
    for key, row in result["synthetic"].items():
        r = row["triroute"]
        assert r["host_syncs_per_step"] == 0 and r["tokens_per_s"] > 0 and row["dense"]["tokens_per_s"] > 0
        assert r["executed_attn_macs"] >= r["audited_attn_macs"] > 0
        assert row["peaks"]["bandwidth_gb_s"] > 0 and row["peaks"]["peak_gflops"] > 0
        if key.endswith(f"_b{max(result['batches'])}"):
            assert r["realised"]["flops"] == pytest.approx(0.55, abs=0.03)


def test_dense_static_step_equals_the_step_that_reads_the_cache_up_to_its_position(bench):
    """`DenseDecoder.static_step` (what a CUDA graph of Dense captures: fixed shapes, the position on the
    device, the keys past it masked) gives `step`'s logits and cache, step after step."""
    m = get_recipe("tiny").triroute.validate().model
    a, b = bench.DenseDecoder(m, batch=2, max_len=12), bench.DenseDecoder(m, batch=2, max_len=12)
    a.fill(5)
    b.fill(5)
    tokens = torch.tensor([[3, 8], [40, 2], [9, 9], [1, 77]])
    for step, row in enumerate(tokens):
        want = a.step(row)
        got = b.static_step(row)
        assert (got - want).abs().max() < 1e-5, step
        assert int(b.pos) == a.t == 6 + step
    assert (a.k - b.k).abs().max() < 1e-6 and (a.v - b.v).abs().max() < 1e-6
    assert b.k[:, :, :, a.t:].abs().max() == 0  # nothing written past the position


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dense_runner_on_cuda_replays_a_graph_equal_to_the_eager_steps(bench):
    m = get_recipe("tiny").triroute.validate().model
    graphed = bench.DenseRunner(m, context=6, batch=2, steps=2, repeats=1, device="cuda")
    eager = bench.DenseRunner(m, context=6, batch=2, steps=2, repeats=1, device="cuda", graphed=False)
    assert graphed.graph is not None and eager.graph is None
    for _ in range(3):
        graphed.step()
        eager.step()
        torch.cuda.synchronize()
        assert torch.equal(graphed.tokens, eager.tokens)
        assert graphed.dec.t == eager.dec.t
    assert (graphed.dec.k - eager.dec.k).abs().max() < 1e-4
