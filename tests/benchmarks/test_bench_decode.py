"""benchmarks/bench_decode.py: its figures are computed from its measurements (no speed targets
here: those live in the benchmark's printed output). `--quick --json` runs in seconds; the Dense
baseline decodes like a full causal forward; the synthetic controller realises its mix; MAC and
KV-byte counts agree with hand computations."""

import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_triroute.routing.quant import kv_bits_per_token
from megatron_triroute.systems import system_config
from megatron_triroute.training.recipes import get_recipe

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_decode.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick():
    """The CLI's --quick --json output (progress goes to stderr, the object to stdout)."""
    run = subprocess.run([sys.executable, str(PATH), "--quick", "--json"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "SYNTHETIC" in run.stderr  # the synthetic shape says so
    return json.loads(run.stdout)


def test_quick_json_fields_are_computed_from_the_measurements(bench, quick):
    rows = quick["synthetic"]
    assert set(rows) == {f"ctx{c}_b{b}" for c in quick["contexts"] for b in quick["batches"]}
    for row in rows.values():
        dense = row["dense"]
        assert dense["tokens_per_s"] == statistics.median(dense["tokens_per_s_runs"]) > 0
        for name in bench.ROUTED:
            r = row[name]
            assert r["tokens_per_s"] == statistics.median(r["tokens_per_s_runs"]) > 0
            assert r["speedup_vs_dense"] == pytest.approx(r["tokens_per_s"] / dense["tokens_per_s"])
            assert r["limit"] == pytest.approx(dense["macs_per_token"] / r["macs_per_token"])
            assert r["efficiency"] == pytest.approx(r["speedup_vs_dense"] / r["limit"])
            assert r["kv_bytes_ratio"] == pytest.approx(r["kv_bytes_per_token"] / dense["kv_bytes_per_token"])
            assert r["cost_audit_rel_err"] < 1e-9  # the audit counts exactly hard_cost's MACs
    ctx, (b1, b8) = quick["headline_context"], (min(quick["batches"]), max(quick["batches"]))
    assert ctx == max(quick["contexts"])  # both quick contexts are below 2,048
    for suffix, b in (("", b1), ("_b8", b8)):
        r = rows[f"ctx{ctx}_b{b}"]["triroute"]
        for key in ("speedup_vs_dense", "limit", "efficiency", "ffn_weight_read_ratio"):
            assert quick[key + suffix] == r[key]
    assert quick["kv_bytes_ratio"] == rows[f"ctx{ctx}_b{b1}"]["triroute"]["kv_bytes_ratio"]
    assert quick["cost_audit_max_rel_err"] == max(r["cost_audit_rel_err"] for row in rows.values()
                                                  for n, r in row.items() if n != "dense")


def test_macs_and_kv_bytes_match_hand_counts(bench):
    """KV-quant-only executes what Dense does (all heads full, dense FFN) plus its controller, and
    stores every token at its uniform width: checked against the Dense decoder's own count and
    kv_bits_per_token."""
    torch.set_grad_enabled(False)
    try:
        cfg = system_config("kvquant", get_recipe("tiny").triroute.validate())
        m, r = cfg.model, cfg.router
        model = bench.build_routed(cfg, bench.DEFAULT_MIX)
        context, steps, repeats = 20, 2, 1
        got = bench.run_routed(model, 2, context, steps, repeats, bench.DEFAULT_MIX["bits"])
        dense = bench.run_dense(m, 2, context, steps, repeats)
        controller = sum(layer.controller_macs for layer in model.layers)
        assert got["macs_per_token"] == pytest.approx(dense["macs_per_token"] + controller)
        assert got["kv_bytes_per_token"] * 8 == m.n_layers * kv_bits_per_token(r.uniform_bits, m.d_kv, r.group_size_for(m))
        assert dense["kv_bytes_per_token"] == m.n_layers * 2 * m.d_kv * 2
    finally:
        torch.set_grad_enabled(True)


def test_dense_decoder_equals_a_full_causal_forward(bench):
    """Step-by-step decode of the Dense baseline against a full-sequence forward written out here
    (explicit causal softmax, float16-rounded K/V as its cache stores them)."""
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
            k, v = rot(k).half().float(), v.half().float()
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


def test_synthetic_controller_realises_its_mix(bench):
    cfg = system_config("triroute", get_recipe("tiny").triroute.validate())
    mix = {"attn": [0.2, 0.5, 0.3], "bits": [0.1, 0.2, 0.3, 0.4], "expert_null": 0.25}
    ctrl = bench.MixController(cfg, 0, mix)
    with torch.no_grad():
        out = ctrl(torch.randn(4, 2048, cfg.model.d_model, generator=torch.Generator().manual_seed(0)), None)
    seen = bench.measure_mix([[out]], len(cfg.router.bits))
    for key in ("attn", "bits"):
        assert seen[key] == pytest.approx(mix[key], abs=0.02)
    assert seen["expert_null"] == pytest.approx(mix["expert_null"], abs=0.02)
