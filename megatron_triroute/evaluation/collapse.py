"""Collapse-cascade curves: per-axis normalised router entropy per layer over training, read from
a run's TensorBoard logs (`router/{attn,experts,bits}/entropy/layer_{l}`, written every
`train.log_interval` steps by `training/metrics.py`), for one or several runs (e.g. with and
without whitening and the entropy floor). A run resumed after a crash may log a step twice; the
last value written wins."""

from __future__ import annotations

import re
from pathlib import Path

AXES = ("attn", "experts", "bits")
TAG = re.compile(r"router/(attn|experts|bits)/entropy/layer_(\d+)")


def entropy_curves(run_dir: str | Path) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """{axis: {layer: [(step, entropy), ...] in step order}} from RUN_DIR/tensorboard."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    log_dir = Path(run_dir) / "tensorboard"
    if not log_dir.is_dir():
        raise FileNotFoundError(f"{log_dir} not found. Fix: pass a run directory (the trainer's output_dir), "
                                "which holds tensorboard/.")
    curves: dict[str, dict[int, dict[int, float]]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime_ns, p.name)):
        acc = EventAccumulator(str(events), size_guidance={SCALARS: 0})
        acc.Reload()
        for tag in acc.Tags()[SCALARS]:
            match = TAG.fullmatch(tag)
            if match:
                points = curves.setdefault(match.group(1), {}).setdefault(int(match.group(2)), {})
                for event in acc.Scalars(tag):
                    points[event.step] = event.value  # later files (a resume) overwrite
    return {axis: {layer: sorted(points.items()) for layer, points in sorted(layers.items())}
            for axis, layers in curves.items()}


def collapse_summary(curves: dict, threshold: float) -> dict[str, dict]:
    """Per axis: the final entropy of each layer, and the first logged step at which any layer was
    below `threshold` (None if never)."""
    out = {}
    for axis, layers in curves.items():
        below = [step for points in layers.values() for step, value in points if value < threshold]
        out[axis] = {"final": {layer: points[-1][1] for layer, points in layers.items() if points},
                     "first_collapse_step": min(below) if below else None}
    return out


def plot_collapse(runs: dict[str, dict], path: Path, threshold: float) -> None:
    """One panel per axis; a colour per run, a line per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_present = [a for a in AXES if any(a in curves for curves in runs.values())]
    fig, panels = plt.subplots(1, max(1, len(axes_present)), figsize=(5 * max(1, len(axes_present)), 3.8),
                               constrained_layout=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, axis in zip(panels[0], axes_present):
        for k, (label, curves) in enumerate(runs.items()):
            for j, (layer, points) in enumerate(curves.get(axis, {}).items()):
                ax.plot([s for s, _ in points], [v for _, v in points], color=colours[k % len(colours)],
                        alpha=0.4 + 0.6 * (j + 1) / max(1, len(curves[axis])), lw=1.2,
                        label=label if j == 0 else None)
        ax.axhline(threshold, color="k", ls=":", lw=1)
        ax.set_title(f"{axis}: normalised entropy per layer", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
    fig.suptitle("Collapse cascade (dotted: the collapse-warning threshold; darker: deeper layer)", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
