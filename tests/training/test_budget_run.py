"""A CI-sized TriRoute run meets its budget: the noise-free policy's realised (FLOPs, memory)
fractions on held-out data end within +-0.05 of the targets."""

import json

from .conftest import log_text, run_to_end

STEPS = 300


def test_ci_sized_run_lands_on_the_budget(tiny_data, tmp_path):
    run = tmp_path / "run"
    # The tiny recipe's default shape, shortened; the training batch is smaller than the recipe's.
    extra = [f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=8",
             "train.save_interval_steps=100000", "optim.warmup_steps=10", "train.log_interval=20"]
    code = run_to_end(run, tiny_data, extra=extra, overrides=[], timeout=600)
    assert code == 0, log_text(run)[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    flops, mem = summary["valid/realised_flops"], summary["valid/realised_mem"]
    assert abs(flops - summary["target_flops"]) <= 0.05, summary
    assert abs(mem - summary["target_mem"]) <= 0.05, summary
    # And the constraint was active: an unpriced TriRoute policy starts near the dense cost.
    first = json.loads((run / "steps.jsonl").read_text().splitlines()[0])
    assert first["realised"][0] > summary["target_flops"] + 0.05 or first["realised"][1] > summary["target_mem"] + 0.05
