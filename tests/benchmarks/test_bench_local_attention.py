"""benchmarks/bench_local_attention.py: this tree's local mode against a baseline copy, interleaved."""

import pytest

from tests.benchmarks import BENCHMARKS, load_benchmark

MODULE = BENCHMARKS.parent / "megatron_triroute" / "model" / "mode_attention.py"


def test_against_a_copy_of_itself_the_outputs_are_equal_and_the_ratio_is_timed(tmp_path):
    bench = load_benchmark("bench_local_attention")
    result = bench.main(["--baseline-file", str(MODULE), "--shape", "tiny", "--rounds", "2", "--iters", "1", "--json"])
    assert result["max_abs_diff"] == 0.0  # the same code on the same inputs
    assert result["ratio_min"] <= result["ratio_median"] <= result["ratio_max"] and result["ratio_min"] > 0
    assert result["this_tree_ms"] > 0 and result["baseline_ms"] > 0


def test_a_changed_baseline_shows_in_its_outputs(tmp_path):
    """A baseline whose windows' gradient lands on the wrong rows differs from this tree: the
    comparison is of two modules."""
    bench = load_benchmark("bench_local_attention")
    broken = MODULE.read_text().replace("span * d, 1), w * d), None, None, None", "span * d, 1), 0), None, None, None")
    assert broken != MODULE.read_text()
    path = tmp_path / "mode_attention.py"
    path.write_text(broken)
    result = bench.main(["--baseline-file", str(path), "--shape", "tiny", "--rounds", "1", "--iters", "1", "--json"])
    assert result["max_abs_diff"] > 1e-3


def test_a_revision_git_cannot_show_names_the_fix():
    bench = load_benchmark("bench_local_attention")
    with pytest.raises(SystemExit, match="--baseline-file"):
        bench.main(["--baseline", "no-such-revision-xyz", "--shape", "tiny", "--rounds", "1"])
