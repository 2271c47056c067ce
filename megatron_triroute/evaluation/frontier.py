"""Matched-budget protocol: sweep points, each system's quality-cost frontier, and the point read
off at the target budget (Sec. Experimental Setup).

A point is one trained run of one system at one knob setting, measured on the hard path: its
realised (FLOPs, KV-memory) fractions and its perplexities. The frontier of a system along one
resource is its Pareto set (no other point of the system is at most as costly and strictly better,
or strictly cheaper and at most as bad). The matched point of a system is its best held-out
perplexity among the points whose realised FLOPs and KV memory are both at or below the targets
(within `tol`); a system with no such point reports its cheapest point, flagged over budget.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

RESOURCES = ("flops", "mem")
BUCKETS = ("rare_entity", "code", "math", "long_context")


@dataclass
class Point:
    system: str
    knobs: dict
    """Config path -> value of the swept knobs (empty for a system without knobs)."""
    run_dir: str
    flops: float
    mem: float
    ppl: float
    buckets: dict = field(default_factory=dict)
    """Tail bucket -> perplexity (buckets with no scored token are absent)."""
    seed: int | None = None
    """The run's `triroute.seed` when the sweep ran several seeds (None: one run, the recipe's seed)."""
    spread: dict = field(default_factory=dict)
    """For a mean over seeds (`average_seeds`): metric -> population std, and "seeds" -> their number."""

    def cost(self, resource: str) -> float:
        return {"flops": self.flops, "mem": self.mem}[resource]

    @property
    def label(self) -> str:
        return ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in self.knobs.items()) or "-"


def pareto(points: list[Point], resource: str) -> list[Point]:
    """The Pareto set of `points` on (cost on `resource`, held-out perplexity), cheapest first."""
    ordered = sorted(points, key=lambda p: (p.cost(resource), p.ppl))
    front, best = [], float("inf")
    for p in ordered:
        if p.ppl < best:
            front.append(p)
            best = p.ppl
    return front


@dataclass
class Matched:
    system: str
    point: Point
    within_budget: bool


def matched_point(points: list[Point], flops_target: float, mem_target: float, tol: float = 0.01) -> Matched:
    """The best held-out perplexity among points within both targets (+ tol); else the cheapest
    point (by the larger overshoot over the two targets), flagged."""
    if not points:
        raise ValueError("no points to read off")
    feasible = [p for p in points if p.flops <= flops_target + tol and p.mem <= mem_target + tol]
    if feasible:
        return Matched(points[0].system, min(feasible, key=lambda p: p.ppl), True)
    cheapest = min(points, key=lambda p: (max(p.flops - flops_target, p.mem - mem_target), p.ppl))
    return Matched(points[0].system, cheapest, False)


def average_seeds(points: list[Point]) -> list[Point]:
    """One point per (system, knobs): the mean over its seeds of every cost and perplexity, with the
    population std of each in `spread` (a bucket counts only if every seed scored it)."""
    import statistics

    groups: dict[tuple, list[Point]] = {}
    for p in points:
        groups.setdefault((p.system, p.label), []).append(p)
    out = []
    for runs in groups.values():
        first = runs[0]
        metrics = {"flops": [p.flops for p in runs], "mem": [p.mem for p in runs], "ppl": [p.ppl for p in runs]}
        metrics |= {b: [p.buckets[b] for p in runs] for b in BUCKETS if all(b in p.buckets for p in runs)}
        mean = {k: statistics.fmean(v) for k, v in metrics.items()}
        spread = {k: statistics.pstdev(v) for k, v in metrics.items()} | {"seeds": len(runs)}
        out.append(Point(first.system, first.knobs, str(Path(first.run_dir).parent) if first.seed is not None
                         else first.run_dir, mean["flops"], mean["mem"], mean["ppl"],
                         {b: mean[b] for b in BUCKETS if b in mean}, spread=spread))
    return out


def by_system(points: list[Point]) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {}
    for p in points:
        out.setdefault(p.system, []).append(p)
    return out


def write_csv(points: list[Point], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["system", "knobs", "seed", "run_dir", "realised_flops", "realised_mem", "valid_ppl",
                    *[f"{b}_ppl" for b in BUCKETS]])
        for p in points:
            w.writerow([p.system, p.label, "" if p.seed is None else p.seed, p.run_dir, f"{p.flops:.4f}",
                        f"{p.mem:.4f}", f"{p.ppl:.4f}",
                        *[f"{p.buckets[b]:.4f}" if b in p.buckets else "" for b in BUCKETS]])


def table2_markdown(matched: list[Matched], flops_target: float, mem_target: float) -> str:
    """The paper's Table 2 layout: one row per system at the matched budget; a point averaged over
    seeds shows mean ± std and the number of seeds."""
    head = ("| system | knob(s) | seeds | FLOPs | KV mem | held-out ppl | "
            + " | ".join(f"{b.replace('_', ' ')} ppl" for b in BUCKETS) + " |")
    lines = [f"Matched budget: FLOPs ≤ {flops_target:.2f}, KV memory ≤ {mem_target:.2f} of the dense model "
             "(realised on the hard path; * = no point of the system within the budget, its cheapest shown; "
             "mean ± population std over seeds).", "",
             head, "|" + "---|" * (6 + len(BUCKETS))]
    for m in matched:
        p = m.point
        flag = "" if m.within_budget else "*"

        def cell(key: str, value: float, digits: int) -> str:
            std = p.spread.get(key)
            return f"{value:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None and p.spread["seeds"] > 1 else "")

        cells = [cell(b, p.buckets[b], 2) if b in p.buckets else "–" for b in BUCKETS]
        lines.append(f"| {m.system}{flag} | {p.label} | {p.spread.get('seeds', 1)} | {cell('flops', p.flops, 3)} | "
                     f"{cell('mem', p.mem, 3)} | {cell('ppl', p.ppl, 2)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_frontiers(points: list[Point], output: Path, flops_target: float, mem_target: float) -> list[Path]:
    """`frontier_flops.png` and `frontier_mem.png`: every point, each system's Pareto frontier, the target."""
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - the analysis extra
        raise RuntimeError("plots need matplotlib. Fix: pip install -c constraints.txt -e '.[analysis]'") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for resource, target in (("flops", flops_target), ("mem", mem_target)):
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for system, pts in by_system(points).items():
            xs, ys = [p.cost(resource) for p in pts], [p.ppl for p in pts]
            (line,) = ax.plot([p.cost(resource) for p in pareto(pts, resource)],
                              [p.ppl for p in pareto(pts, resource)], "-", label=system)
            ax.scatter(xs, ys, color=line.get_color(), s=18)
        ax.axvline(target, color="grey", linestyle=":", label="target")
        ax.set_xlabel(f"realised {'FLOPs' if resource == 'flops' else 'KV memory'} (fraction of dense)")
        ax.set_ylabel("held-out perplexity")
        ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(output / f"frontier_{resource}.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files
