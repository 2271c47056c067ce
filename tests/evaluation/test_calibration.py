"""Prices on served checkpoints (evaluation/calibration.py, inference/prices.py): a mid-run
checkpoint records uncalibrated prices and is served with a warning; `--calibrate` brings its
realised cost on the calibration batches to the target; an unreachable target (no null expert)
is detected at the cost floor computed by hand."""

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_triroute.evaluate import main


def _evaluate(capsys, *args):
    rc = main(list(args))
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out), out.err


def _meta(step_dir):
    return json.loads((step_dir / "meta.json").read_text())


def test_mid_run_checkpoint_warns_and_calibrates_on_request(trained_run, capsys):
    from megatron_triroute.checkpoint.store import step_dir_name
    from megatron_triroute.evaluation.loading import load_for_evaluation
    from megatron_triroute.evaluation.perplexity import evaluate_sets, run_datasets
    from megatron_triroute.training import data as data_mod

    summary = json.loads((trained_run / "summary.json").read_text())
    mid, final = (trained_run / "checkpoints" / step_dir_name(s) for s in (3, 6))
    assert _meta(mid)["prices"] == {"calibrated": False, "step": None, "feasible": None, "prices": [0.0, 0.0]}
    assert _meta(final)["prices"] == {"calibrated": True, "step": 6, "feasible": summary["calibration"]["feasible"],
                                      "prices": summary["calibration"]["prices"]}

    served, err = _evaluate(capsys, "--checkpoint", str(mid), "--eval-batches", "1", "--json")
    assert "prices not calibrated (checkpoint written mid-run at step 3)" in err and "--calibrate" in err
    assert served["prices"]["calibrated"] is False and served["calibration"] is None
    _, err = _evaluate(capsys, "--checkpoint", str(final), "--eval-batches", "1", "--json")
    assert "not calibrated" not in err

    calibrated, err = _evaluate(capsys, "--checkpoint", str(mid), "--eval-batches", "1", "--json", "--calibrate")
    assert "not calibrated" not in err
    record, cal = calibrated["prices"], calibrated["calibration"]
    assert record["calibrated"] is True and record["step"] == 3 and record["prices"] == cal["prices"]
    targets = cal["targets"]
    # A second measurement of the same calibration batches (the step-3 global batch): unpriced it
    # is over a target, with the calibrated prices at or under both.
    loaded = load_for_evaluation(mid)
    with run_datasets(loaded) as (run, dp, train, _):
        batches = data_mod.calibration_batches(train, run, 3, dp)
    assert len(batches) == 2

    def realised(prices):
        loaded.model.prices.copy_(torch.tensor(prices, dtype=torch.float64))
        r = evaluate_sets(loaded.model, {"c": batches})[0]
        return [r.realised_flops, r.realised_mem]

    before, after = realised([0.0, 0.0]), realised(record["prices"])
    assert before == pytest.approx(cal["realised_before"], abs=1e-9)
    assert any(b > t + 0.01 for b, t in zip(before, targets)), (before, targets)
    assert after == pytest.approx(cal["realised_after"], abs=1e-9)
    assert all(a <= t + 0.01 for a, t in zip(after, targets)), (after, targets)
    # The held-out set is served with those prices: not the unpriced policy's cost.
    assert calibrated["metrics"]["valid/realised_flops"] != served["metrics"]["valid/realised_flops"]


def test_generate_export_and_lm_eval_warn_and_export_calibrates(trained_run, tmp_path, capsys, caplog):
    from megatron_triroute import generate
    from megatron_triroute.checkpoint.store import step_dir_name
    from megatron_triroute.evaluation.harness import TriRouteLM
    from megatron_triroute.export.exporter import export
    from megatron_triroute.export.safetensors_io import read_weights

    mid = trained_run / "checkpoints" / step_dir_name(3)
    assert generate.main(["--checkpoint", str(mid), "--prompt", "The", "--max-new-tokens", "1", "--json"]) == 0
    assert "prices not calibrated (checkpoint written mid-run at step 3)" in capsys.readouterr().err
    with caplog.at_level("WARNING"):
        TriRouteLM(checkpoint=str(mid))
        assert "prices not calibrated" in caplog.text and "calibrate=true" in caplog.text
        caplog.clear()
        export(mid, tmp_path / "plain")
        assert "prices not calibrated" in caplog.text and "--calibrate" in caplog.text
        caplog.clear()
        export(mid, tmp_path / "calibrated", calibrate=True)
        assert "not calibrated" not in caplog.text
    plain, calibrated = (json.loads((tmp_path / d / "config.json").read_text())["prices"]
                         for d in ("plain", "calibrated"))
    assert plain == _meta(mid)["prices"]
    assert calibrated["calibrated"] is True and calibrated["step"] == 3 and calibrated["prices"] != [0.0, 0.0]
    assert read_weights(tmp_path / "calibrated")["model.prices"].tolist() == calibrated["prices"]


def test_no_null_expert_target_below_the_ffn_floor_is_infeasible(caplog):
    from megatron_triroute.evaluation.calibration import calibrate_model
    from megatron_triroute.inference.model import InferenceModel
    from megatron_triroute.routing.cost import expert_width

    from tests.routing.helpers import tiny_config

    cfg = tiny_config(null_expert=False)
    cfg.budget.flops_target, cfg.budget.mem_target = 0.5, 1.0
    m, r = cfg.model, cfg.router
    torch.manual_seed(0)
    model = InferenceModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, m.vocab_size, (4, m.seq_len + 1), generator=g)
    batches = [SimpleNamespace(tokens=tokens[:2, :-1], labels=tokens[:2, 1:], loss_mask=torch.ones(2, m.seq_len)),
               SimpleNamespace(tokens=tokens[2:, :-1], labels=tokens[2:, 1:], loss_mask=torch.ones(2, m.seq_len))]
    dual = {"lambdas": torch.tensor([0.5, 0.0], dtype=torch.float64)}
    with caplog.at_level("WARNING", logger="megatron_triroute.training.calibrate"):
        cal = calibrate_model(model, dual, batches)
    # By hand: top-2 real experts of width d_f / 2 always run (dense FFN MACs 3 d d_f per token and
    # layer); with every head skipping, the FLOPs fraction is sum_t 3 d d_f / sum_t (2 d (t+1) + 3 d d_f).
    assert r.top_k * expert_width(m, r) == m.d_ff
    t = torch.arange(m.seq_len, dtype=torch.float64)
    floor = float((3 * m.d_model * m.d_ff * len(t)) / (2 * m.d_model * (t + 1) + 3 * m.d_model * m.d_ff).sum())
    assert cal["realised_before"][0] > floor + 0.01
    assert cal["feasible"][0] is False and cal["realised_after"][0] == pytest.approx(floor, abs=1e-9)
    assert 0 < cal["prices"][0] < 2.0**11  # capped where the floor is reached, not at the bracket's top
    assert "flops target 0.5 cannot be met" in caplog.text and f"{floor:.4f}" in caplog.text
