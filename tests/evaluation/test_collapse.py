"""Collapse-cascade curves read back from TensorBoard logs written by the trainer's own writer,
including a resumed run that logs a step again (the later value wins)."""

import pytest

from megatron_triroute.evaluation.collapse import collapse_summary, entropy_curves
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
