"""`python -m megatron_triroute.evaluate` on a real six-step run: its held-out and tail-bucket
perplexities, computed by the inference engine, agree with the trainer's own end-of-run
evaluation in `summary.json` (the Megatron model in eval mode), and so do the realised fractions."""

import json
import math

import pytest
import torch

from megatron_triroute.evaluate import main


def _run(capsys, *args):
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_agrees_with_the_trainers_evaluation(trained_run, capsys):
    summary = json.loads((trained_run / "summary.json").read_text())
    config = json.loads((trained_run / "config.json").read_text())
    rc, out, err = _run(capsys, "--checkpoint", str(trained_run / "checkpoints"), "--json")
    assert rc == 0, err
    assert torch.is_grad_enabled()  # main() runs without autograd only inside itself
    result = json.loads(out)
    metrics = result["metrics"]
    assert result["step"] == summary["step"] == 6
    assert metrics["valid/ppl"] == pytest.approx(summary["valid/ppl"], rel=1e-5)
    assert metrics["valid/realised_flops"] == pytest.approx(summary["valid/realised_flops"], abs=1e-6)
    assert metrics["valid/realised_mem"] == pytest.approx(summary["valid/realised_mem"], abs=1e-6)
    buckets = {k for k in summary if k.endswith("_ppl") and k != "valid/ppl"}
    assert buckets and buckets == {k for k in metrics if k.endswith("_ppl") and k != "valid/ppl"}
    for key in buckets:
        assert metrics[key] == pytest.approx(summary[key], rel=1e-5), key
    # The held-out set is the trainer's: train.eval_batches micro-batches of full sequences.
    t, seq_len = config["train"], config["triroute"]["model"]["seq_len"]
    valid = result["sets"]["valid"]
    assert valid["scored_tokens"] == valid["run_tokens"] == t["eval_batches"] * t["micro_batch_size"] * seq_len
    assert valid["ppl"] == pytest.approx(math.exp(valid["nll"]), rel=1e-12)
    assert "ETA" in err and "tokens/s" in err  # the progress line
    # A bucket runs only up to its last scored token; a bucket with no documents reports empty.
    for name, s in result["sets"].items():
        if s["ppl"] is None:
            assert s["scored_tokens"] == 0 and f"valid/{name}_ppl" not in summary
        else:
            assert 0 < s["scored_tokens"] <= s["run_tokens"] and 0 < s["realised_mem"] < 1


def test_text_table_and_clear_errors(trained_run, capsys, tmp_path):
    rc, out, err = _run(capsys, "--checkpoint", str(trained_run / "checkpoints"), "--eval-batches", "1")
    assert rc == 0, err
    assert "held-out" in out and "perplexity" in out and "realised FLOPs" in out
    rc, out, err = _run(capsys, "--checkpoint", str(tmp_path))
    assert rc == 2 and "no checkpoint under" in err and "Fix:" in err
    rc, out, err = _run(capsys, "--checkpoint", str(trained_run / "checkpoints"), "--data", str(tmp_path / "nowhere"))
    assert rc == 2 and "--data DIR" in err
