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
    n_layers = get_recipe("tiny").triroute.model.n_layers
    ops = {op["name"]: op for op in shares["ops"]}
    assert ops["triroute::paged_attention"]["calls_per_step"] == n_layers
    assert ops["triroute::routed_experts"]["calls_per_step"] == n_layers


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
