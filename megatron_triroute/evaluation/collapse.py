"""Collapse-cascade curves: per-axis normalised router entropy per layer over training, read from
a run's TensorBoard logs (`router/{attn,experts,bits}/entropy/layer_{l}`, written every
`train.log_interval` steps by `training/metrics.py`), for one or several runs (e.g. with and
without whitening and the entropy floor), and each expert's load over training
(`router/experts/fraction_{null,e0,...}`). A run resumed after a crash may log a step twice; the
last value written wins."""

from __future__ import annotations

import re
from pathlib import Path

AXES = ("attn", "experts", "bits")
TAG = re.compile(r"router/(attn|experts|bits)/entropy/layer_(\d+)")
LOAD_TAG = re.compile(r"router/experts/fraction_(null|e\d+)")


def _read_scalars(run_dir: str | Path, pattern: re.Pattern) -> dict[tuple, dict[int, float]]:
    """{tag's match groups: {step: value}} of the TensorBoard scalars under RUN_DIR/tensorboard whose
    tag matches `pattern` in full (event files oldest first: a resumed run's later values win)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    log_dir = Path(run_dir) / "tensorboard"
    if not log_dir.is_dir():
        raise FileNotFoundError(f"{log_dir} not found. Fix: pass a run directory (the trainer's output_dir), "
                                "which holds tensorboard/.")
    out: dict[tuple, dict[int, float]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime_ns, p.name)):
        acc = EventAccumulator(str(events), size_guidance={SCALARS: 0})
        acc.Reload()
        for tag in acc.Tags()[SCALARS]:
            match = pattern.fullmatch(tag)
            if match:
                points = out.setdefault(match.groups(), {})
                for event in acc.Scalars(tag):
                    points[event.step] = event.value
    return out


def entropy_curves(run_dir: str | Path) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """{axis: {layer: [(step, entropy), ...] in step order}} from RUN_DIR/tensorboard."""
    curves: dict[str, dict[int, list]] = {}
    for (axis, layer), points in sorted(_read_scalars(run_dir, TAG).items(), key=lambda kv: (kv[0][0], int(kv[0][1]))):
        curves.setdefault(axis, {})[int(layer)] = sorted(points.items())
    return curves


def expert_load_curves(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{option ("null", "e0", ...): [(step, share of the top-k expert slots it takes), ...]}: each
    expert's load over training, all layers together (`router/experts/fraction_{option}`; the shares
    sum to 1); empty without expert routing."""
    loads = _read_scalars(run_dir, LOAD_TAG)
    order = sorted(loads, key=lambda k: (k[0] != "null", int(k[0][1:]) if k[0] != "null" else -1))
    return {k[0]: sorted(loads[k].items()) for k in order}


def load_summary(loads: dict[str, list[tuple[int, float]]], share: float = 0.1) -> dict:
    """Mean load per option over the last `share` of the logged steps, and the ratio of the most to
    the least loaded real expert (1 = perfectly balanced; inf = an expert never used)."""
    if not loads:
        return {}
    means = {}
    for option, points in loads.items():
        tail = points[-max(1, int(round(share * len(points)))):]
        means[option] = sum(v for _, v in tail) / len(tail)
    real = [v for k, v in means.items() if k != "null"]
    ratio = (max(real) / min(real)) if real and min(real) > 0 else float("inf")
    return {"final_load": means, "max_over_min": ratio}


def plot_expert_load(runs: dict[str, dict], path: Path) -> None:
    """One panel per run: each expert's load (and the null expert's) over training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {label: loads for label, loads in runs.items() if loads}
    fig, panels = plt.subplots(1, max(1, len(runs)), figsize=(4.2 * max(1, len(runs)), 3.6), constrained_layout=True,
                               squeeze=False, sharey=True)
    for ax, (label, loads) in zip(panels[0], runs.items()):
        for option, points in loads.items():
            ax.plot([s for s, _ in points], [v for _, v in points], lw=1.2, ls="--" if option == "null" else "-",
                    label=option)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    panels[0][0].set_ylabel("share of expert slots")
    fig.suptitle("Expert load over training (all layers; dashed: the null expert)", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
