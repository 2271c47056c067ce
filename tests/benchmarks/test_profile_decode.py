"""benchmarks/profile_decode.py: the shares are the profiled steps' and the decode ops are counted
once per layer and step."""

import pytest
import torch

from megatron_triroute.training.recipes import get_recipe
from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def shares():
    with torch.no_grad():
        return load_benchmark("profile_decode").op_shares("tiny", context=32, batch=2, steps=2)


def test_each_layer_runs_one_attention_and_one_expert_call_a_step(shares):
    """Inside the one-call step too: its kernels are profiled under their ops' names."""
    n_layers = get_recipe("tiny").triroute.model.n_layers
    ops = {op["name"]: op for op in shares["ops"]}
    assert ops["triroute::decode_layers"]["calls_per_step"] == 1
    for name in ("controller_logits", "decode_decisions", "decode_qkv", "cache_append"):
        assert ops[f"triroute::{name}"]["calls_per_step"] == n_layers
    assert ops["triroute::paged_attention"]["calls_per_step"] == n_layers
    assert ops["triroute::routed_experts"]["calls_per_step"] == n_layers
    assert ops["triroute::rms_norm"]["calls_per_step"] == 2 * n_layers + 1


@pytest.mark.parametrize("theirs,their_op", [("op by op", "triroute.paged_attention"),
                                               ("layer", "triroute.decode_layer")])
def test_the_layers_in_one_call_against_their_other_forms_alternate_steps(theirs, their_op):
    from benchmarks.op_counter import StepCounter

    bench = load_benchmark("profile_decode")
    n_layers = get_recipe("tiny").triroute.model.n_layers
    counter = StepCounter()
    with torch.no_grad(), counter:
        result = bench.fused_against("tiny", context=32, batch=2, rounds=2, warmup=1, theirs=theirs)
    steps = 1 + 2  # each side: the warm-up and the timed rounds
    assert counter.foreign_ops["triroute.decode_layers"] == steps  # one side's steps
    assert counter.foreign_ops[their_op] == steps * n_layers  # the other's
    assert result["this_tree_ms"] > 0 and result["baseline_ms"] > 0
    assert result["ratio_q1"] <= result["ratio_median"] <= result["ratio_q3"]


def test_the_audit_against_none_alternates_audited_and_plain_steps(monkeypatch):
    """Every other step audited: as many audited steps as plain ones, warm-up and timed rounds alike."""
    bench = load_benchmark("profile_decode")
    audits = []
    real = bench.bench_decode.RoutedRunner.step

    def step(runner, audit=None, *args, **kwargs):
        audits.append(audit is not None)
        return real(runner, audit, *args, **kwargs)

    monkeypatch.setattr(bench.bench_decode.RoutedRunner, "step", step)
    with torch.no_grad():
        result = bench.audit_against_none("tiny", context=32, batch=2, rounds=2, warmup=1)
    assert sum(audits) == len(audits) - sum(audits) == 1 + 2  # each side: the warm-up and the timed rounds
    assert result["this_tree_ms"] > 0 and result["baseline_ms"] > 0
    assert result["ratio_q1"] <= result["ratio_median"] <= result["ratio_q3"]


def test_the_cli_refuses_two_comparisons(capsys):
    for two in (["--baseline", "HEAD", "--against-op-by-op"], ["--against-op-by-op", "--against-base-pages"],
                ["--against-layer-calls", "--against-op-by-op"], ["--against-no-audit", "--against-base-pages"]):
        with pytest.raises(SystemExit) as stop:
            load_benchmark("profile_decode").main(two)
        assert stop.value.code == 2 and "give one" in capsys.readouterr().err


def test_huge_against_base_pages_places_one_runner_and_alternates_steps(monkeypatch):
    from megatron_triroute.inference.huge_pages import huge_pages_available

    if not huge_pages_available():
        pytest.skip("the kernel offers no transparent huge pages here")
    bench = load_benchmark("profile_decode")
    placed = []
    monkeypatch.setattr(bench.bench_decode, "place_on_huge_pages", lambda model: placed.append(model) or 0)
    with torch.no_grad():
        result = bench.huge_against_base_pages("tiny", context=32, batch=2, rounds=2, warmup=1)
    assert len(placed) == 1  # the huge-page runner's model, not the other's
    assert result["this_tree_ms"] > 0 and result["baseline_ms"] > 0
    assert result["ratio_q1"] <= result["ratio_median"] <= result["ratio_q3"]


def test_shares_add_up_to_the_profiled_time(shares):
    assert sum(op["share"] for op in shares["ops"]) == pytest.approx(1.0)
    assert sum(op["ms_per_step"] for op in shares["ops"]) == pytest.approx(shares["step_ms"])
    assert [op["share"] for op in shares["ops"]] == sorted((op["share"] for op in shares["ops"]), reverse=True)


def test_the_cli_prints_one_json_object_with_the_top_ops(capsys):
    import json

    load_benchmark("profile_decode").main(["--shape", "tiny", "--context", "32", "--batch", "2", "--steps", "1",
                                           "--top", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["shape"] == "tiny" and out["batch"] == 2 and len(out["ops"]) == 3
    assert out["ops"][0]["ms_per_step"] >= out["ops"][2]["ms_per_step"] > 0


@pytest.fixture
def probe():
    """`torch.ops.triroute_probe.decode_linear`: counts its calls and runs the package's op."""
    original = torch.ops.triroute.decode_linear
    calls = []
    lib = torch.library.Library("triroute_probe", "DEF")
    lib.define("decode_linear(Tensor x, Tensor w) -> Tensor")

    def counted(x, w):
        calls.append(x.shape[0])
        return original(x, w)

    lib.impl("decode_linear", counted, "CPU")
    yield calls
    lib._destroy()


def test_an_op_swap_routes_the_package_calls_and_gives_them_back(probe):
    from triroute_kernels import decode_linear

    swap = load_benchmark("profile_decode").OpSwap("triroute_probe")
    assert swap.names == ["decode_linear"]
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    with swap:
        inside = decode_linear(x, w)
    assert probe == [3]
    assert torch.equal(decode_linear(x, w), inside) and probe == [3]  # the package's op again


def test_steps_against_a_baseline_run_its_ops_on_every_other_step(shares, probe):
    bench = load_benchmark("profile_decode")
    with torch.no_grad():
        result = bench.step_against("triroute_probe", "tiny", context=32, batch=2, rounds=4, warmup=1)
    per_step = shares["ops"][[op["name"] for op in shares["ops"]].index("triroute::decode_linear")]["calls_per_step"]
    assert per_step > 0 and len(probe) == (1 + 4) * per_step  # the swapped steps only, warm-up included
    assert result["this_tree_ms"] > 0 and result["baseline_ms"] > 0
    assert result["ratio_q1"] <= result["ratio_median"] <= result["ratio_q3"]


def test_an_op_swap_needs_ops_under_its_namespace():
    with pytest.raises(ValueError, match="triroute_nothing"):
        load_benchmark("profile_decode").OpSwap("triroute_nothing")


def test_the_cli_refuses_no_rounds(capsys):
    with pytest.raises(SystemExit) as stop:
        load_benchmark("profile_decode").main(["--baseline", "HEAD", "--rounds", "0"])
    assert stop.value.code == 2 and "--rounds 0" in capsys.readouterr().err


def test_an_op_swap_refuses_a_stand_in_with_other_arguments():
    lib = torch.library.Library("triroute_probe_other", "DEF")
    lib.define("decode_linear(Tensor x) -> Tensor")
    lib.impl("decode_linear", lambda x: x, "CPU")
    try:
        with pytest.raises(ValueError, match=r"decode_linear\(Tensor x\) -> Tensor.*this tree's schemas"):
            load_benchmark("profile_decode").OpSwap("triroute_probe_other")
    finally:
        lib._destroy()
