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


def by_system(points: list[Point]) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {}
    for p in points:
        out.setdefault(p.system, []).append(p)
    return out


def write_csv(points: list[Point], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["system", "knobs", "run_dir", "realised_flops", "realised_mem", "valid_ppl",
                    *[f"{b}_ppl" for b in BUCKETS]])
        for p in points:
            w.writerow([p.system, p.label, p.run_dir, f"{p.flops:.4f}", f"{p.mem:.4f}", f"{p.ppl:.4f}",
                        *[f"{p.buckets[b]:.4f}" if b in p.buckets else "" for b in BUCKETS]])


def table2_markdown(matched: list[Matched], flops_target: float, mem_target: float) -> str:
    """The paper's Table 2 layout: one row per system at the matched budget."""
    head = ("| system | knob(s) | FLOPs | KV mem | held-out ppl | "
            + " | ".join(f"{b.replace('_', ' ')} ppl" for b in BUCKETS) + " |")
    lines = [f"Matched budget: FLOPs ≤ {flops_target:.2f}, KV memory ≤ {mem_target:.2f} of the dense model "
             "(realised on the hard path; * = no point of the system within the budget, its cheapest shown).", "",
             head, "|" + "---|" * (5 + len(BUCKETS))]
    for m in matched:
        p = m.point
        flag = "" if m.within_budget else "*"
        cells = [f"{p.buckets[b]:.2f}" if b in p.buckets else "–" for b in BUCKETS]
        lines.append(f"| {m.system}{flag} | {p.label} | {p.flops:.3f} | {p.mem:.3f} | {p.ppl:.2f} | "
                     + " | ".join(cells) + " |")
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
