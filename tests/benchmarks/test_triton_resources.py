"""benchmarks/triton_resources.py: the all-pools attention compiled for sm_90 without a GPU, its
resources read from the cubin."""

import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("triton_resources")


def test_compiled_resources_of_two_block_sizes(bench):
    full = bench.compile_report()
    small = bench.compile_report(PB=1, NPOOLS=1)
    for r in (full, small):
        assert r["arch"] == "sm_90" and 0 < r["registers"] <= 255
        assert r["programs_per_sm_by_registers"] == 65_536 // (r["registers"] * 32 * r["num_warps"])
    # one page per iteration stages a quarter of the slots: less shared memory, registers no higher
    assert small["shared_bytes"] < full["shared_bytes"]
    assert small["registers"] <= full["registers"]
    assert full["knobs"]["PB"] == 4 and small["knobs"]["PB"] == 1


def test_an_unknown_constant_is_refused(bench):
    with pytest.raises(ValueError, match="PAGES"):
        bench.compile_report(PAGES=2)


def test_aligned_loads_vectorise_and_a_register_cap_holds(bench):
    """Compiled as a launch specialises it (16-byte aligned tensors): the packed rows' loads are
    vector loads; `maxnreg` caps the registers; the codes-domain block compiles for sm_90."""
    capped = bench.compile_report(maxnreg=96, CODES=1, EARLY=1, NPOOLS=1, PB=1)
    assert capped["vector_loads"] > 0 and capped["registers"] <= 96
    assert capped["programs_per_sm_by_registers"] >= 5
