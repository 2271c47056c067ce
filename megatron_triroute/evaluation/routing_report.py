"""Figures (PNG) and a markdown report of a `routing_analysis.Routing` (matplotlib: the
`analysis` extra)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from ..durability import write_text_atomic
from .routing_analysis import (CATEGORIES, RESOURCE_LABELS, RESOURCES, Routing, category_band_means, cross_axis_mi,
                               depth_bands, kmeans, routing_vectors)


def analyse(routing: Routing, pieces: list[str], n_bits: int, n_experts: int, clusters: int = 8, seed: int = 0,
            top: int = 8) -> dict:
    """Every number the report shows, as plain JSON-able values."""
    bands = depth_bands(routing.n_layers)
    heat = {k: category_band_means(routing.cost[k], routing.categories, bands) for k in RESOURCES}
    labels, _ = kmeans(routing_vectors(routing, n_bits, n_experts), clusters, seed)
    groups = []
    for j in np.unique(labels):
        rows = labels == j
        common = Counter(routing.tokens[rows].tolist()).most_common(top)
        groups.append({"cluster": int(j), "tokens": int(rows.sum()),
                       "flops": float(routing.cost["flops"][rows].mean()), "mem": float(routing.cost["mem"][rows].mean()),
                       "attention": float(routing.cost["attention"][rows].mean()),
                       "experts": float(routing.cost["experts"][rows].mean()),
                       "categories": {CATEGORIES[c]: int(n) for c, n in Counter(routing.categories[rows].tolist()).most_common(3)},
                       "top_tokens": [[pieces[t] if t < len(pieces) else f"<{t}>", n] for t, n in common]})
    groups.sort(key=lambda g: -g["tokens"])
    counts = np.bincount(routing.categories, minlength=len(CATEGORIES))
    return {"tokens": int(len(routing.tokens)), "layers": routing.n_layers, "bands": bands,
            "category_tokens": {c: int(n) for c, n in zip(CATEGORIES, counts)},
            "heatmaps": {k: [[None if np.isnan(v) else float(v) for v in row] for row in heat[k]] for k in heat},
            "clusters": groups, "mutual_information": cross_axis_mi(routing, seed)}


def analyse_checkpoint(loaded, batches: list, out: Path, runs: dict[str, str], clusters: int = 8, seed: int = 0,
                       page_size: int = 16) -> list[Path]:
    """`python -m megatron_triroute.analyze`: the routing of `loaded` (a `loading.Loaded`) over the
    held-out `batches` through the engine, analysed and written under `out` with the collapse-cascade
    and expert-load curves of `runs` ({label: run directory}; none given: the checkpoint's own run,
    when it logged to TensorBoard). Returns the files written."""
    from .collapse import entropy_curves, expert_load_curves
    from ..progress import Progress
    from .routing_analysis import collect

    sp = loaded.processor
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    routing = collect(loaded.model, batches, pieces, page_size, Progress(sum(mb.tokens.numel() for mb in batches)))
    r = loaded.model.config.router
    result = analyse(routing, pieces, len(r.bits) if r.bit_routing else 1, r.num_experts, clusters, seed)
    own = loaded.step_path.parent.parent
    if not runs and (own / "tensorboard").is_dir():
        runs = {own.name: str(own)}
    collapse = {label: entropy_curves(run_dir) for label, run_dir in runs.items()}
    loads = {label: expert_load_curves(run_dir) for label, run_dir in runs.items()}
    threshold = float(loaded.tree.get("train", {}).get("collapse_entropy", 0.1))
    return write_report(result, out, str(loaded.step_path), loaded.step, collapse, threshold, loads)


def write_report(result: dict, out: Path, checkpoint: str, step: int, collapse: dict | None = None,
                 threshold: float = 0.1, loads: dict | None = None) -> list[Path]:
    """The figures, `routing_analysis.json` and `routing_report.md` under `out`. `collapse`:
    {run label: `collapse.entropy_curves(run_dir)`} for the collapse-cascade figure and section;
    `loads`: {run label: `collapse.expert_load_curves(run_dir)`} for the expert-load ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    files = []
    bands = result["bands"]
    band_names = [f"layers {b[0]}-{b[-1]}" if len(b) > 1 else f"layer {b[0]}" for b in bands]
    fig, axes = plt.subplots(1, len(RESOURCES), figsize=(4.2 * len(RESOURCES), 4.2), constrained_layout=True)
    for ax, key in zip(axes, RESOURCES):
        data = np.array([[np.nan if v is None else v for v in row] for row in result["heatmaps"][key]])
        im = ax.imshow(data, aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(bands)), band_names, rotation=30)
        ax.set_yticks(range(len(CATEGORIES)), [f"{c} ({result['category_tokens'][c]})" for c in CATEGORIES]
                      if key == RESOURCES[0] else [""] * len(CATEGORIES))
        ax.set_title(RESOURCE_LABELS[key], fontsize=10)
        for (i, j), v in np.ndenumerate(data):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w", fontsize=8)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle("Resource spent by token category x depth band (held-out tokens, deployed policy)")
    files.append(out / "routing_heatmap.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    layers = range(result["layers"])
    for pair, values in result["mutual_information"].items():
        line, = ax.plot(layers, [v[0] for v in values], marker="o", label=pair)
        ax.plot(layers, [v[1] for v in values], ls=":", color=line.get_color())
    ax.set_xlabel("layer")
    ax.set_ylabel("mutual information (bits)")
    ax.set_xticks(list(layers))
    ax.set_title("Cross-axis mutual information (dotted: one axis shuffled)", fontsize=10)
    ax.legend()
    files.append(out / "routing_mutual_information.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    groups = result["clusters"]
    ax.scatter([g["flops"] for g in groups], [g["mem"] for g in groups], s=[30 + 400 * g["tokens"] / result["tokens"]
                                                                         for g in groups])
    for g in groups:
        ax.annotate(f"{g['cluster']}: {' '.join(t for t, _ in g['top_tokens'][:3])}", (g["flops"], g["mem"]), fontsize=7)
    ax.set_xlabel("FLOPs / dense")
    ax.set_ylabel("KV bits / 16-bit")
    ax.set_title("k-means clusters of routing vectors (area: tokens)", fontsize=10)
    files.append(out / "routing_clusters.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    summaries = None
    if collapse:
        from .collapse import collapse_summary, plot_collapse

        files.append(out / "collapse_cascade.png")
        plot_collapse(collapse, files[-1], threshold)
        summaries = {label: collapse_summary(curves, threshold) for label, curves in collapse.items()}
        result = dict(result, collapse=summaries, collapse_threshold=threshold)
    if loads and any(loads.values()):
        from .collapse import load_summary, plot_expert_load

        files.append(out / "expert_load.png")
        plot_expert_load(loads, files[-1])
        result = dict(result, expert_load={label: load_summary(curves) for label, curves in loads.items() if curves})
    write_text_atomic(out / "routing_analysis.json", json.dumps(result, indent=1))
    files.append(out / "routing_analysis.json")
    files.append(out / "routing_report.md")
    files[-1].write_text(markdown(result, checkpoint, step))
    return files


def markdown(result: dict, checkpoint: str, step: int) -> str:
    bands = result["bands"]
    head = " | ".join(f"layers {b[0]}-{b[-1]}" if len(b) > 1 else f"layer {b[0]}" for b in bands)
    lines = [f"# Routing analysis: {checkpoint} (step {step})", "",
             f"{result['tokens']:,} held-out tokens (the trainer's validation micro-batches), the deployed policy "
             "(noise-free priced decisions, as the inference engine runs them). Definitions: "
             "`megatron_triroute/evaluation/routing_analysis.py`.", "",
             "## Resource spent by token category and depth band", "", "![heatmap](routing_heatmap.png)", ""]
    for key in RESOURCES:
        lines += [f"**{RESOURCE_LABELS[key]}**", "", f"| category | tokens | {head} |",
                  "|---|---:|" + "---:|" * len(bands)]
        for c, row in zip(CATEGORIES, result["heatmaps"][key]):
            cells = " | ".join("" if v is None else f"{v:.3f}" for v in row)
            lines.append(f"| {c} | {result['category_tokens'][c]:,} | {cells} |")
        lines.append("")
    lines += ["## k-means clusters of routing vectors", "",
              "Routing vector: per layer, one-hot attention mode per head, expert multi-hot (null included), "
              "one-hot KV width.", "", "![clusters](routing_clusters.png)", "",
              "| cluster | tokens | FLOPs / dense | KV bits / 16 | attention reads | experts run | main categories | most frequent tokens |",
              "|---:|---:|---:|---:|---:|---:|---|---|"]
    for g in result["clusters"]:
        cats = ", ".join(f"{c} {n}" for c, n in g["categories"].items())
        toks = " ".join(f"`{t.replace('|', '¦').replace('`', chr(39))}` {n}" for t, n in g["top_tokens"])
        lines.append(f"| {g['cluster']} | {g['tokens']:,} | {g['flops']:.3f} | {g['mem']:.3f} | {g['attention']:.3f} | "
                     f"{g['experts']:.2f} | {cats} | {toks} |")
    lines += ["", "## Cross-axis mutual information per layer", "",
              "Plug-in estimate in bits between the token's decisions on two axes (attention: the tuple of head "
              "modes; experts: the set chosen; bits: the KV width). *shuffled* pairs the same values at random: "
              "the estimator's bias at this sample size, what independent axes would show.", "",
              "![mutual information](routing_mutual_information.png)", "",
              "| layer | " + " | ".join(f"{p} | {p} shuffled" for p in result["mutual_information"]) + " |",
              "|---:|" + "---:|---:|" * len(result["mutual_information"])]
    for layer in range(result["layers"]):
        cells = " | ".join(f"{v[layer][0]:.3f} | {v[layer][1]:.3f}" for v in result["mutual_information"].values())
        lines.append(f"| {layer} | {cells} |")
    if result.get("collapse"):
        lines += ["", "## Collapse cascade", "",
                  "Normalised entropy of each axis's marginal routing distribution per layer over training, from "
                  f"each run's TensorBoard logs; a layer below {result['collapse_threshold']} is what the trainer "
                  "warns about as a collapse.", "", "![collapse cascade](collapse_cascade.png)", "",
                  "| run | axis | final entropy per layer | first step with a layer below the threshold |",
                  "|---|---|---|---:|"]
        for label, axes in result["collapse"].items():
            for axis, summary in axes.items():
                finals = " ".join(f"{v:.2f}" for v in summary["final"].values())
                first = summary["first_collapse_step"]
                lines.append(f"| {label} | {axis} | {finals} | {'never' if first is None else first} |")
    if result.get("expert_load"):
        options = list(next(iter(result["expert_load"].values()))["final_load"])
        lines += ["", "## Expert load", "",
                  "Share of the top-k expert slots each expert takes (all layers; the shares sum to 1) over training, "
                  "from each run's TensorBoard logs; the table shows the mean over the last 10 % of the logged steps "
                  "and the ratio of the most to the least loaded real expert.", "", "![expert load](expert_load.png)",
                  "", "| run | " + " | ".join(options) + " | max / min |", "|---|" + "---:|" * (len(options) + 1)]
        for label, summary in result["expert_load"].items():
            cells = " | ".join(f"{summary['final_load'].get(o, float('nan')):.3f}" for o in options)
            lines.append(f"| {label} | {cells} | {summary['max_over_min']:.2f} |")
    return "\n".join(lines) + "\n"
