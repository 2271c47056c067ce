"""benchmarks/bench_generate.py --quick: both models generate exactly the tokens asked for, every
figure is computed from the timed rounds, and TriRoute's forced mix realises the budget."""

import statistics

import pytest
from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def quick():
    bench = load_benchmark("bench_generate")
    return bench, bench.main(["--quick", "--json"])


def test_both_models_generate_the_requested_tokens_and_the_ratios_come_from_the_rounds(quick):
    bench, r = quick
    new = r["new_tokens"]
    assert r["shape"] == "tiny" and r["repeats"] == 2 and new == 4
    # (model, tokens asked, tokens generated): the whole generation and the prompt alone, both models
    assert r["tokens_generated"] == [["hf", 1, 1], ["hf", new, new], ["triroute", 1, 1], ["triroute", new, new]]
    runs = r["seconds_runs"]
    assert all(len(v) == r["repeats"] and min(v) > 0 for v in runs.values())
    for label in ("whole", "prompt"):
        ratios = [a / b for a, b in zip(runs[f"triroute_{label}"], runs[f"hf_{label}"])]
        assert r[f"{label}_ratio"]["median"] == pytest.approx(statistics.median(ratios))
        assert r["seconds"][f"hf_{label}"]["median"] == pytest.approx(statistics.median(runs[f"hf_{label}"]))
    decode = [(w - p) / (new - 1) for w, p in zip(runs["triroute_whole"], runs["triroute_prompt"])]
    assert r["decode_seconds_per_token"]["triroute"]["median"] == pytest.approx(statistics.median(decode))


def test_the_forced_mix_realises_the_budget_over_prompt_and_generated_tokens(quick):
    from megatron_triroute.training.recipes import get_recipe

    _, r = quick
    budget = get_recipe("tiny").triroute.budget
    assert r["realised_fractions"]["flops"] == pytest.approx(budget.flops_target, abs=0.03)
    assert r["realised_fractions"]["mem"] == pytest.approx(budget.mem_target, abs=0.02)


def test_the_transformers_model_is_the_dense_export_of_the_shape(quick):
    """The model transformers runs has the Dense exporter's Llama config for the shape."""
    bench, _ = quick
    from megatron_triroute.systems import system_config
    from megatron_triroute.training.recipes import get_recipe

    config = system_config("triroute", get_recipe("tiny").triroute.validate())
    llama = bench.build_llama(config)
    m = config.model
    c = llama.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size) == (m.d_model, m.d_ff, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab_size)
    dense_params = sum(p.numel() for p in llama.parameters())
    from megatron_triroute.training.recipes import dense_parameter_count

    assert dense_params == dense_parameter_count(get_recipe("tiny-dense").triroute)


def test_budget_dial_generates_at_each_target_in_the_same_rounds():
    """`--budgets`: the same model generates once more per target, interleaved with transformers; the
    dial's ratios come from those rounds, and each target's forced mix realises it."""
    bench = load_benchmark("bench_generate")
    r = bench.main(["--quick", "--json", "--budgets", "0.5,0.3", "1,1"])
    new, runs = r["new_tokens"], r["seconds_runs"]
    assert [(d["system"], d["flops_target"], d["mem_target"]) for d in r["budget_dial"]] == [
        ("triroute@0.5,0.3", 0.5, 0.3), ("triroute@1,1", 1.0, 1.0)]
    for d in r["budget_dial"]:
        name = d["system"]
        assert [name, new, new] in r["tokens_generated"] and [name, 1, 1] in r["tokens_generated"]
        for label in ("whole", "prompt"):
            assert len(runs[f"{name}_{label}"]) == r["repeats"]
            ratios = [a / b for a, b in zip(runs[f"{name}_{label}"], runs[f"hf_{label}"])]
            assert d[f"{label}_ratio"]["median"] == pytest.approx(statistics.median(ratios))
        per_token = [((w - p) / (new - 1)) / ((hw - hp) / (new - 1)) for w, p, hw, hp in zip(
            runs[f"{name}_whole"], runs[f"{name}_prompt"], runs["hf_whole"], runs["hf_prompt"])]
        assert d["decode_ratio"]["median"] == pytest.approx(statistics.median(per_token))
    low, full = (d["realised_fractions"] for d in r["budget_dial"])
    assert full == {"flops": pytest.approx(1.0), "mem": pytest.approx(1.0)}  # every decision the dense one
    assert low["flops"] == pytest.approx(0.5, abs=0.03) and low["mem"] == pytest.approx(0.3, abs=0.02)
