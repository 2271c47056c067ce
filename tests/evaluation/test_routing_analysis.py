"""Routing analysis: its statistics against hand computations, the per-token costs against the
engine's own cost audit, and the command end to end on a real run (figures and report written)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_triroute.evaluation.routing_analysis import (CATEGORIES, category_band_means, categorize, collect,
                                                           depth_bands, kmeans, mutual_information)
from megatron_triroute.evaluation.scoring import score_batch
from megatron_triroute.inference.audit import CostAudit
from tests.inference.test_engine import tiny_model


def test_mutual_information_by_hand():
    a = np.array([0, 0, 1, 1] * 25)
    assert mutual_information(a, a) == pytest.approx(1.0)  # H(a) = 1 bit
    assert mutual_information(a, np.array([0, 1, 0, 1] * 25)) == pytest.approx(0.0, abs=1e-12)  # independent
    # P(a, b): (0,0) 3/8, (0,1) 1/8, (1,0) 1/8, (1,1) 3/8 -> 1 - H(1/4) bits
    b = np.array([0, 0, 0, 1, 1, 1, 1, 0])
    a2 = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    h = -(0.25 * np.log2(0.25) + 0.75 * np.log2(0.75))
    assert mutual_information(a2, b) == pytest.approx(1 - h)
    rows = np.array([[0, 1], [0, 1], [2, 2], [2, 2]])  # tuples count as one value each
    assert mutual_information(rows, np.array([5, 5, 7, 7])) == pytest.approx(1.0)


def test_kmeans_recovers_separated_groups():
    rng = np.random.default_rng(0)
    centres = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = np.concatenate([c + rng.normal(0, 0.5, (40, 2)) for c in centres])
    labels, found = kmeans(x, 3, seed=1)
    truth = np.repeat(np.arange(3), 40)
    for j in range(3):  # each found cluster is exactly one true group
        assert len(set(truth[labels == j])) == 1 and (labels == j).sum() == 40
    assert np.allclose(np.sort(found, 0), np.sort(centres, 0), atol=0.3)
    assert np.array_equal(kmeans(x, 3, seed=1)[0], labels)  # deterministic for a seed


def test_categories_and_band_means_by_hand():
    pieces = ["<eod>", "\u2581The", "\u2581cat", "\u2581sat", ".", "\u2581the", "\u2581Paris", "\u25811999", "(",
              "<0x0A>", "<0xC3>", "\u2581zyx"]
    log_prob = np.array([0, -2, -3, -3, -1, -1, -9, -5, -2, -2, -8, -12], dtype=float)
    tokens = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 5, 3, 2, 2, 5, 3, 2, 5])
    prev = np.concatenate([[-1], tokens[:-1]])
    got = [CATEGORIES[c] for c in categorize(tokens, prev, log_prob, 0, pieces)]
    assert got[:11] == ["sentence-initial", "content word", "content word", "code symbol", "sentence-initial",
                        "rare/entity", "number", "code symbol", "code symbol", "sentence-initial", "rare/entity"]
    # (a newline starts a sentence, so <0xC3> after it is sentence-initial; "zyx" is in the rarest 10 %)
    assert got[11:14] == ["content word", "function word", "content word"]
    assert CATEGORIES[categorize(np.array([10]), np.array([2]), log_prob, 0, pieces)[0]] == "rare/entity"
    assert depth_bands(4) == [[0, 1], [2], [3]] and depth_bands(2) == [[0], [1]]
    values = np.arange(12, dtype=float).reshape(4, 3)  # 4 tokens x 3 layers
    cats = np.array([0, 0, 2, 5])
    means = category_band_means(values, cats, [[0, 1], [2]])
    assert means[0].tolist() == [np.mean([0, 1, 3, 4]), np.mean([2, 5])]
    assert means[2].tolist() == [6.5, 8.0] and means[5].tolist() == [9.5, 11.0]
    assert np.isnan(means[1]).all()


def test_per_token_costs_add_up_to_the_engine_audit():
    model = tiny_model()
    torch.manual_seed(1)
    tokens = torch.randint(1, 64, (3, 10))
    batches = [SimpleNamespace(tokens=tokens, labels=torch.roll(tokens, -1, 1))]
    pieces = [f"\u2581w{i}" for i in range(64)]
    routing = collect(model, batches, pieces)
    audit = CostAudit(model.config.model.n_layers)
    score_batch(model, [r.tolist() for r in tokens], [r.tolist() for r in batches[0].labels], audit)
    # KV memory: every token's dense memory is the same, so the audit's fraction is the plain mean.
    assert routing.cost["mem"].mean() == pytest.approx(audit.realised_mem(), rel=1e-9)
    # FLOPs: the audit's fraction is the dense-weighted mean of the per-token fractions.
    m = model.config.model
    dense = 2.0 * m.d_model * (routing.positions[:, None] + 1.0) + 3.0 * m.d_model * m.d_ff
    dense = np.broadcast_to(dense, routing.cost["flops"].shape)
    assert (routing.cost["flops"] * dense).sum() / dense.sum() == pytest.approx(audit.realised_flops(), rel=1e-9)
    assert routing.attn.shape == (30, m.n_layers, m.n_heads) and routing.bits.shape == (30, m.n_layers)
    assert set(np.unique(routing.attn)) <= {0, 1, 2} and routing.experts.shape[:2] == (30, m.n_layers)


def test_command_writes_figures_and_report(trained_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from megatron_triroute.analyze import main

    out = tmp_path / "analysis"
    assert main(["--checkpoint", str(trained_run / "checkpoints"), "--output", str(out), "--clusters", "4"]) == 0
    names = {"routing_heatmap.png", "routing_clusters.png", "routing_mutual_information.png", "routing_report.md",
             "routing_analysis.json", "collapse_cascade.png", "expert_load.png"}
    assert {p.name for p in out.iterdir()} == names
    for name in names:
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "routing_analysis.json").read_text())
    config = json.loads((trained_run / "config.json").read_text())
    t = config["train"]
    assert result["tokens"] == t["eval_batches"] * t["micro_batch_size"] * config["triroute"]["model"]["seq_len"]
    assert sum(result["category_tokens"].values()) == result["tokens"]
    assert sum(g["tokens"] for g in result["clusters"]) == result["tokens"] and len(result["clusters"]) <= 4
    report = (out / "routing_report.md").read_text()
    for heading in ("Resource spent by token category", "k-means clusters", "Cross-axis mutual information",
                    "Collapse cascade"):
        assert heading in report
    # The collapse curves are the run's own: one entropy per logged step (log_interval 1) and layer.
    collapse = result["collapse"]["run"]
    n_layers = config["triroute"]["model"]["n_layers"]
    assert set(collapse) == {"attn", "experts", "bits"}
    assert all(len(axis["final"]) == n_layers for axis in collapse.values())
    # The expert loads too: every real expert and the null expert, shares of the slots summing to 1.
    load = result["expert_load"]["run"]["final_load"]
    r = config["triroute"]["router"]
    assert list(load) == ["null"] + [f"e{i}" for i in range(r["num_experts"])]
    assert sum(load.values()) == pytest.approx(1.0, rel=1e-4)
    assert "## Expert load" in report
