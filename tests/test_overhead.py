"""`python -m megatron_triroute.overhead` on the tiny recipe, against an analytic count.

The controller of one layer (Eq. router), from the architecture:

    input RMSNorm(d)                                   d
    trunk  Linear(d + F -> d_r), Linear(d_r -> d_r)    (d + F) d_r + d_r + d_r d_r + d_r
           RMSNorm(d_r)                                d_r
    heads  Linear(d_r -> n, no bias) + gain + bias     d_r n + 2 n,  n = 3H (attention, per head),
                                                       E + 1 (experts + null), |B| (bits)

with F = 3 static side features + 3 attention-mode fractions + 1 expert fraction + |B| bit
one-hot of the previous layer. Its forward FLOPs per token (2 per multiply-accumulate, matmuls
only, which is what FlopCounterMode counts): 2 [(d + F) d_r + d_r d_r + d_r (3H + E + 1 + |B|)].
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_triroute.training.recipes import get_recipe

REPO = Path(__file__).resolve().parents[1]


def _shape():
    cfg = get_recipe("tiny").triroute
    m, r = cfg.model, cfg.router
    return m, r, 3 + 3 + 1 + len(r.bits)


def controller_params_per_layer() -> int:
    m, r, F = _shape()
    d, d_r = m.d_model, r.d_router
    trunk = d + (d + F) * d_r + d_r + d_r * d_r + d_r + d_r
    heads = sum(d_r * n + 2 * n for n in (3 * m.n_heads, r.num_experts + 1, len(r.bits)))
    return trunk + heads


def controller_flops_per_token_per_layer() -> int:
    m, r, F = _shape()
    d, d_r = m.d_model, r.d_router
    return 2 * ((d + F) * d_r + d_r * d_r + d_r * (3 * m.n_heads + r.num_experts + 1 + len(r.bits)))


def dense_params() -> int:
    """Untied embedding and output layer, per layer GQA attention + SwiGLU FFN + two RMSNorms,
    final RMSNorm."""
    m, _, _ = _shape()
    d, d_h = m.d_model, m.d_model // m.n_heads
    attn = d * (m.n_heads + 2 * m.n_kv_heads) * d_h + m.n_heads * d_h * d
    return 2 * m.vocab_size * d + m.n_layers * (attn + 3 * d * m.d_ff + 2 * d) + d


def dense_train_flops_per_token() -> int:
    """Dense training forward, 2 FLOPs per MAC: per layer the QKV and output projections, one
    full causal read (the dense system never reads in local mode, so the relaxed path skips it:
    a T x T product of q.k and of the weights with V, 2 * 2 * T * d_h per head) and the SwiGLU
    FFN; then the output layer."""
    m, _, _ = _shape()
    d, d_h, T = m.d_model, m.d_model // m.n_heads, m.seq_len
    qkv_proj = 2 * d * (m.n_heads + 2 * m.n_kv_heads) * d_h + 2 * m.n_heads * d_h * d
    reads = 2 * 2 * T * d_h * m.n_heads
    return m.n_layers * (qkv_proj + reads + 2 * 3 * d * m.d_ff) + 2 * d * m.vocab_size


@pytest.fixture(scope="module")
def reports():
    """The full build and a one-layer build scaled to four, run side by side."""
    commands = {
        "full": ["--recipe", "tiny", "--json"],
        "scaled": ["--recipe", "tiny", "--json", "--layers", "1"],
    }
    procs = {k: subprocess.Popen([sys.executable, "-m", "megatron_triroute.overhead", *args], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, args in commands.items()}
    out = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out[k] = json.loads(stdout)
    return out


def test_controller_counts_match_the_architecture(reports):
    report = reports["full"]
    m, _, _ = _shape()
    L = m.n_layers
    assert report["layers_built"] == report["n_layers"] == L
    tri, dense = report["systems"]["triroute"], report["systems"]["dense"]
    assert [l["params_controller"] for l in tri["per_layer"]] == [controller_params_per_layer()] * L
    assert tri["params_controller"] == L * controller_params_per_layer()
    assert [l["flops_per_token_controller"] for l in tri["per_layer"]] == [controller_flops_per_token_per_layer()] * L
    assert tri["flops_per_token_controller"] == L * controller_flops_per_token_per_layer()
    assert dense["params_total"] == dense_params()
    assert dense["flops_per_token_total"] == dense_train_flops_per_token()
    assert dense["params_controller"] == 0 and dense["flops_per_token_controller"] == 0


def test_shares_are_fractions(reports):
    tri, dense = (reports["full"]["systems"][s] for s in ("triroute", "dense"))
    for key in ("params_share", "flops_share", "controller_flops_vs_dense"):
        assert 0.0 < tri[key] < 1.0, (key, tri[key])
    assert tri["params_share"] == tri["params_controller"] / tri["params_total"]
    assert tri["flops_share"] == tri["flops_per_token_controller"] / tri["flops_per_token_total"]
    assert dense["params_share"] == dense["flops_share"] == 0.0


def test_one_layer_scaled_to_the_recipe_matches_the_full_build(reports):
    full, scaled = (reports[k]["systems"] for k in ("full", "scaled"))
    assert reports["scaled"]["layers_built"] == 1
    for system in ("triroute", "dense"):
        for key in ("params_total", "params_controller", "flops_per_token_controller"):
            assert scaled[system][key] == full[system][key], (system, key)


def test_configuration_errors_exit_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "megatron_triroute.overhead", "--recipe", "tiny",
                           "triroute.router.d_routr=8"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: override 'triroute.router.d_routr': unknown field"), proc.stderr


def test_a_process_group_of_one_leaves_the_environment_as_it_was(monkeypatch):
    """Built in a test process, it must not leave its rank behind for the processes the next tests
    start, nor take a rendezvous port (a world of one meets through an in-process store)."""
    import os

    from megatron_triroute.distributed.one_process import single_process_parallel

    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("MASTER_PORT", "1")  # unusable: a TCP rendezvous here would fail
    with single_process_parallel():
        assert os.environ["RANK"] == "0" and os.environ["MASTER_PORT"] == "1"
    assert os.environ["RANK"] == "7" and os.environ["MASTER_PORT"] == "1"
