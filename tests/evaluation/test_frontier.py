"""Frontier and read-off of the matched-budget protocol, against hand-worked point sets."""

import csv

import pytest

from megatron_triroute.evaluation.frontier import (Point, average_seeds, matched_point, pareto, table2_markdown,
                                                   write_csv)


def pt(flops, mem, ppl, system="s", **buckets):
    return Point(system, {"router.top_k": int(flops * 10)}, f"runs/{flops}", flops, mem, ppl, buckets)


def test_pareto_keeps_only_points_no_cheaper_point_beats():
    a, b, c, d = pt(0.3, 0.5, 40.0), pt(0.5, 0.2, 30.0), pt(0.6, 0.9, 35.0), pt(0.9, 0.1, 25.0)
    # on FLOPs: c (0.6, 35) is beaten by the cheaper b (0.5, 30)
    assert pareto([c, d, a, b], "flops") == [a, b, d]
    # on memory (0.1: d 25, 0.2: b 30, 0.5: a 40, 0.9: c 35): only d is on the frontier
    assert pareto([a, b, c, d], "mem") == [d]


def test_matched_point_is_the_best_within_both_targets_else_the_least_over():
    a, b, c = pt(0.50, 0.40, 40.0), pt(0.55, 0.395, 38.0), pt(0.70, 0.30, 30.0)
    m = matched_point([a, b, c], 0.55, 0.40, tol=0.0)
    assert m.within_budget and m.point is b  # c is better but over the FLOPs target
    m = matched_point([c, pt(0.9, 0.2, 20.0)], 0.55, 0.40, tol=0.0)
    assert not m.within_budget and m.point is c  # overshoot 0.15 against 0.35
    assert matched_point([pt(0.56, 0.40, 39.0)], 0.55, 0.40, tol=0.01).within_budget


def test_csv_and_table_carry_every_point_and_bucket(tmp_path):
    p = pt(0.5, 0.4, 40.0, system="moe", code=12.5)
    write_csv([p], tmp_path / "points.csv")
    rows = list(csv.DictReader(open(tmp_path / "points.csv")))
    assert rows == [{"system": "moe", "knobs": "top_k=5", "seed": "", "run_dir": "runs/0.5", "realised_flops": "0.5000",
                     "realised_mem": "0.4000", "valid_ppl": "40.0000", "rare_entity_ppl": "", "code_ppl": "12.5000",
                     "math_ppl": "", "long_context_ppl": ""}]
    table = table2_markdown([matched_point([p], 0.4, 0.4, tol=0.0)], 0.4, 0.4)
    assert "| moe* | top_k=5 | 1 | 0.500 | 0.400 | 40.00 | – | 12.50 | – | – |" in table


def test_seeds_average_to_mean_and_population_std_per_point():
    """Three seeds of one point and one seed of another: means and population stds by hand; a
    bucket one seed did not score is left out of the mean."""
    def seeded(seed, flops, ppl, **buckets):
        return Point("tr", {"budget.flops_target": 0.55}, f"runs/tr/seed{seed}", flops, 0.4, ppl, buckets, seed=seed)

    runs = [seeded(1, 0.50, 30.0, code=10.0, math=7.0), seeded(2, 0.52, 33.0, code=13.0),
            seeded(3, 0.54, 36.0, code=16.0, math=9.0), pt(0.9, 0.9, 20.0, system="dense")]
    means = {p.system: p for p in average_seeds(runs)}
    tr = means["tr"]
    assert (tr.flops, tr.ppl, tr.buckets) == (pytest.approx(0.52), pytest.approx(33.0), {"code": pytest.approx(13.0)})
    assert tr.spread["seeds"] == 3 and tr.run_dir == "runs/tr"
    assert tr.spread["ppl"] == pytest.approx(6.0 ** 0.5)  # deviations 3, 0, 3: variance 18 / 3
    assert means["dense"].spread == {"flops": 0.0, "mem": 0.0, "ppl": 0.0, "seeds": 1}
    table = table2_markdown([matched_point([tr], 0.55, 0.40, tol=0.01)], 0.55, 0.40)
    assert "| tr | flops_target=0.55 | 3 | 0.520 ± 0.016 | 0.400 ± 0.000 | 33.00 ± 2.45 | – | 13.00 ± 2.45 | – | – |" \
        in table
