"""Collapse-cascade curves read back from TensorBoard logs written by the trainer's own writer,
including a resumed run that logs a step again (the later value wins)."""

import pytest

from megatron_triroute.evaluation.collapse import collapse_summary, entropy_curves, expert_load_curves, load_summary
from megatron_triroute.training.metrics import TensorBoard


def write(log_dir, values: dict[int, dict[str, float]]) -> None:
    tb = TensorBoard(str(log_dir))
    for step, scalars in sorted(values.items()):
        tb.scalars(scalars, step)
    tb.close()


def test_curves_and_summary_read_back(tmp_path):
    run = tmp_path / "run"
    first = {s: {"router/attn/entropy/layer_0": 0.9 - 0.1 * s, "router/attn/entropy/layer_1": 0.8,
                 "router/bits/entropy/layer_0": 0.5, "train/lm_loss": 3.0} for s in range(4)}
    write(run / "tensorboard", first)
    # A resume from step 2 logs steps 2..4 again with other values.
    write(run / "tensorboard", {s: {"router/attn/entropy/layer_0": 0.05 * s} for s in range(2, 5)})
    curves = entropy_curves(run)
    assert set(curves) == {"attn", "bits"} and set(curves["attn"]) == {0, 1}
    layer0 = curves["attn"][0]
    assert [s for s, _ in layer0] == [0, 1, 2, 3, 4]
    assert [v for _, v in layer0] == pytest.approx([0.9, 0.8, 0.1, 0.15, 0.2])
    assert curves["attn"][1] == [(s, pytest.approx(0.8)) for s in range(4)]
    summary = collapse_summary(curves, threshold=0.12)
    assert summary["attn"]["first_collapse_step"] == 2
    assert summary["attn"]["final"] == {0: pytest.approx(0.2), 1: pytest.approx(0.8)}
    assert summary["bits"]["first_collapse_step"] is None
    with pytest.raises(FileNotFoundError, match="Fix: pass a run directory"):
        entropy_curves(tmp_path / "nowhere")


def test_expert_load_curves_and_imbalance(tmp_path):
    """Per-expert load read back in option order (null first), the tail mean and the max/min ratio
    by hand; an expert never used gives an infinite ratio; a run without experts has no curves."""
    run = tmp_path / "run"
    write(run / "tensorboard", {s: {"router/experts/fraction_e1": 0.2 + 0.1 * s, "router/experts/fraction_e0": 0.8,
                                    "router/experts/fraction_null": 0.4, "router/attn/fraction_full": 0.5}
                                for s in range(10)})
    loads = expert_load_curves(run)
    assert list(loads) == ["null", "e0", "e1"]
    assert loads["e1"][-1] == (9, pytest.approx(1.1))
    summary = load_summary(loads)  # the last 10 % of 10 logged steps: step 9 alone
    assert summary["final_load"] == {"null": pytest.approx(0.4), "e0": pytest.approx(0.8), "e1": pytest.approx(1.1)}
    assert summary["max_over_min"] == pytest.approx(1.1 / 0.8)
    assert load_summary({"e0": [(0, 0.0)], "e1": [(0, 2.0)]})["max_over_min"] == float("inf")
    quiet = tmp_path / "dense"
    write(quiet / "tensorboard", {0: {"router/attn/fraction_full": 1.0}})
    assert expert_load_curves(quiet) == {} and load_summary({}) == {}
