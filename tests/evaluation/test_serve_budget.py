"""Budgets per request on a real (six-step) run's checkpoint: the price curve sampled on its
training batches, held-out prompts served at several budgets in one batch land within 0.02 of
their targets over 64 generated tokens, and the command lines (generate with a JSONL prompts file,
evaluate, the lm-eval model) pass the targets through and refuse an infeasible one with exit
status 2 naming the reachable range; the Hugging Face export, with the curve in its config,
generates the engine's tokens at the same per-row targets and realises the same fractions."""

import json
import shutil

import pytest
import torch

from tests.hf_home import isolate_hf_home

isolate_hf_home()  # keep remote code and caches out of the home directory, offline

from megatron_triroute.evaluation import calibration
from megatron_triroute.evaluation.loading import load_for_evaluation

TOLERANCE = 0.02
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def served(trained_run):
    """(loaded checkpoint, its price curve, held-out prompts)."""
    from megatron_triroute.evaluation.perplexity import evaluation_sets

    loaded = load_for_evaluation(trained_run / "checkpoints", None)
    curve = calibration.curve_loaded(loaded)
    rows = [row[:8].tolist() for mb in evaluation_sets(loaded)["valid"] for row in mb.tokens]
    return loaded, curve, rows[:4]


def _inside(curve, r, share):
    lo, hi = curve.reachable(r)
    return round(lo + share * (hi - lo), 3)


def test_held_out_requests_at_mixed_budgets_meet_their_targets(served):
    from megatron_triroute.inference.engine import InferenceEngine

    loaded, curve, prompts = served
    assert curve.reachable(0)[1] - curve.reachable(0)[0] > 0.1 and curve.reachable(1)[1] - curve.reachable(1)[0] > 0.1
    targets = [(_inside(curve, 0, a), _inside(curve, 1, b)) for a, b in ((0.2, 0.8), (0.5, 0.5), (0.8, 0.2), (0.35, 0.65))]
    engine = InferenceEngine(loaded.model, price_curve=curve)
    done = engine.run(prompts, NEW_TOKENS, None, targets)
    for r, target in zip(done, targets):
        assert len(r.generated) == NEW_TOKENS
        realised = engine.realised(r.rid)
        assert abs(realised[0] - target[0]) <= TOLERANCE and abs(realised[1] - target[1]) <= TOLERANCE, (target, realised)
    # The curve's prices alone (no control) miss by more: the control is what meets the targets.
    fixed = InferenceEngine(loaded.model, price_curve=curve, control=False)
    missed = [fixed.realised(r.rid) for r in fixed.run(prompts, NEW_TOKENS, None, targets)]
    assert max(abs(m[i] - t[i]) for m, t in zip(missed, targets) for i in range(2)) > TOLERANCE


def test_generate_takes_per_request_targets_and_refuses_an_infeasible_one(served, trained_run, tmp_path, capsys,
                                                                          monkeypatch):
    from megatron_triroute import generate

    loaded, curve, _ = served
    monkeypatch.setattr(calibration, "curve_loaded", lambda *args, **kwargs: curve)  # sampled once, above
    target = _inside(curve, 0, 0.5)
    prompts = tmp_path / "requests.jsonl"
    prompts.write_text(json.dumps({"prompt": "The history of", "target_flops": target}) + "\n"
                       + json.dumps({"prompt": "def main():"}) + "\n")
    args = ["--checkpoint", str(trained_run / "checkpoints"), "--prompts-file", str(prompts), "--max-new-tokens", "8",
            "--json"]
    assert generate.main(args + ["--target-mem", str(_inside(curve, 1, 0.5))]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["target_flops"], r["target_mem"]) for r in out["requests"]] == [(target, _inside(curve, 1, 0.5)),
                                                                               (None, _inside(curve, 1, 0.5))]
    assert all(0 < r["realised_flops"] <= 1.5 for r in out["requests"])
    low = curve.reachable(0)[0]
    assert generate.main(args + ["--target-flops", str(round(low - 0.05, 3))]) == 2
    err = capsys.readouterr().err
    assert f"FLOPs target {round(low - 0.05, 3):g} is infeasible" in err and f"from {low:.4f}" in err
    prompts.write_text('{"prompt": "x", "target_flop": 0.5}\n')
    assert generate.main(args) == 2
    assert "unknown field(s) ['target_flop']" in capsys.readouterr().err


def test_evaluate_and_the_lm_eval_model_serve_at_the_targets(served, trained_run, capsys, monkeypatch):
    from megatron_triroute import evaluate

    loaded, curve, _ = served
    monkeypatch.setattr(calibration, "curve_loaded", lambda *args, **kwargs: curve)
    target = (_inside(curve, 0, 0.3), _inside(curve, 1, 0.7))
    want = [curve.price_for(0, target[0]), curve.price_for(1, target[1])]
    assert evaluate.main(["--checkpoint", str(trained_run / "checkpoints"), "--json", "--target-flops", str(target[0]),
                          "--target-mem", str(target[1])]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["targets"]["served_prices"] == want
    assert abs(out["sets"]["valid"]["realised_flops"] - target[0]) < 0.05  # the curve's prices alone, held-out text
    pytest.importorskip("lm_eval")
    from megatron_triroute.evaluation.harness import TriRouteLM
    from megatron_triroute.inference import engine as engine_mod

    lm = TriRouteLM(checkpoint=str(trained_run / "checkpoints"), target_flops=str(target[0]), target_mem=target[1])
    assert lm.model.prices.tolist() == want and lm.get_model_info()["triroute_targets"] == {"flops": target[0],
                                                                                           "mem": target[1]}
    added = []
    original = engine_mod.InferenceEngine.add
    monkeypatch.setattr(engine_mod.InferenceEngine, "add",
                        lambda self, *a, **k: added.append(a[3:]) or original(self, *a, **k))
    from lm_eval.api.instance import Instance

    lm.generate_until([Instance("generate_until", {}, ("The history of", {"until": ["\n"], "max_gen_toks": 4}), 0)],
                      disable_tqdm=True)
    assert added == [target]


def test_the_hf_export_serves_each_row_at_its_targets_as_the_engine_does(served, trained_run, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from megatron_triroute.export.exporter import export
    from megatron_triroute.inference.engine import InferenceEngine

    loaded, curve, prompts = served

    def known_curve(target, *args, **kwargs):
        target.prices = dict(target.prices, curve=curve.to_dict())
        return curve

    monkeypatch.setattr(calibration, "curve_loaded", known_curve)
    out = export(trained_run / "checkpoints", tmp_path / "hf", price_curve=True)
    assert json.loads((out / "config.json").read_text())["prices"]["curve"] == curve.to_dict()
    card = (out / "README.md").read_text()
    assert "target_flops=F" in card and f"FLOPs {curve.reachable(0)[0]:.3f} to {curve.reachable(0)[1]:.3f}" in card
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    targets = [(_inside(curve, 0, 0.25), _inside(curve, 1, 0.75)), (_inside(curve, 0, 0.75), None)]
    n = 24
    # The end token: the one row 0 generates sixth, so that row 0 stops early (and generate feeds it
    # padding from then on, which its realised cost leaves out, as the engine does) and row 1 may not.
    free = InferenceEngine(loaded.model, price_curve=curve).run(prompts[:2], n, None, targets)
    stop = free[0].generated[5]
    monkeypatch.setattr(hf.config, "eos_token_id", stop)
    result = hf.generate(torch.tensor(prompts[:2]), max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                         eos_token_id=stop, pad_token_id=stop,
                         target_flops=[t[0] for t in targets], target_mem=[t[1] for t in targets])
    sequences = hf.realised_cost(result.past_key_values)["sequences"]
    engine = InferenceEngine(loaded.model, price_curve=curve)
    done = engine.run(prompts[:2], n, stop, targets)
    assert len(done[0].generated) <= 6 < n
    for b, r in enumerate(done):
        new = result.sequences[b, len(prompts[b]):].tolist()
        assert new[: len(r.generated)] == r.generated, b
        assert sequences[b] == pytest.approx(engine.realised(r.rid), abs=1e-12), b
    with pytest.raises(ValueError, match="is infeasible"):
        hf.generate(torch.tensor(prompts[:1]), max_new_tokens=2, target_flops=curve.reachable(0)[0] - 0.05)


def test_a_sampled_curve_is_kept_beside_the_checkpoint_and_read_back_only_for_the_same_weights(served, tmp_path,
                                                                                              monkeypatch):
    import dataclasses
    import shutil

    loaded, curve, _ = served
    step = tmp_path / loaded.step_path.name
    shutil.copytree(loaded.step_path, step)
    (step / calibration.CURVE_CACHE).unlink(missing_ok=True)  # the fixture's own sampling left one
    sampled = []
    monkeypatch.setattr(calibration, "curve_model", lambda *a, **k: sampled.append(1) or curve)

    def fresh():
        return dataclasses.replace(loaded, step_path=step, prices={k: v for k, v in loaded.prices.items() if k != "curve"})

    first = calibration.curve_loaded(fresh())
    cache = json.loads((step / calibration.CURVE_CACHE).read_text())
    assert len(sampled) == 1 and cache["curve"] == curve.to_dict() and len(cache["manifest_sha256"]) == 64
    again = calibration.curve_loaded(fresh())
    assert len(sampled) == 1 and again.to_dict() == first.to_dict()  # read back, not sampled
    (step / calibration.CURVE_CACHE).write_text(json.dumps(cache | {"manifest_sha256": "0" * 64}))
    calibration.curve_loaded(fresh())
    assert len(sampled) == 2  # another checkpoint's curve is never trusted
    (step / calibration.CURVE_CACHE).write_text("{not json")
    calibration.curve_loaded(fresh())
    assert len(sampled) == 3 and json.loads((step / calibration.CURVE_CACHE).read_text())["curve"] == curve.to_dict()
