"""`python -m megatron_triroute.generate` on a real (two-step) training run's checkpoint: the
tokenizer comes from the run's data directory, greedy output is reproducible, the JSON has the
documented fields; the loader refuses a non-1/1/1 layout and a checkpoint missing a tensor."""

import json
import subprocess
import sys

import pytest
import torch

from tests.training.conftest import REPO, TINY_OVERRIDES, run_to_end


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gen") / "run"
    rc = run_to_end(run_dir, tiny_data, overrides=TINY_OVERRIDES + ["train.steps=2"])
    assert rc == 0, (run_dir.parent / "run.log").read_text()[-3000:]
    return run_dir / "checkpoints"


def _generate(ckpt, *args):
    out = subprocess.run([sys.executable, "-m", "megatron_triroute.generate", "--checkpoint", str(ckpt), *args],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_generate_json_and_text(trained, tmp_path):
    a = json.loads(_generate(trained, "--prompt", "The history of", "--max-new-tokens", "6", "--json"))
    b = json.loads(_generate(trained, "--prompt", "The history of", "--max-new-tokens", "6", "--json"))
    assert set(a) == {"text", "token_ids", "tokens_per_s", "realised_flops", "realised_mem"}
    assert a["token_ids"] == b["token_ids"] and 1 <= len(a["token_ids"]) <= 6
    assert a["tokens_per_s"] > 0 and 0 < a["realised_flops"] <= 1.5 and 0 < a["realised_mem"] <= 1.0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\nsecond one\n")
    many = json.loads(_generate(trained, "--prompts-file", str(prompts), "--max-new-tokens", "3", "--json",
                                "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"))
    assert len(many["text"]) == 2 and len(many["token_ids"]) == 2
    text = _generate(trained, "--prompt", "The history of", "--max-new-tokens", "4")
    assert "tokens/s" in text and "realised FLOPs" in text and "realised KV memory" in text


def test_loader_refuses_other_layouts_and_missing_tensors(trained, tmp_path):
    from megatron_triroute.checkpoint.store import latest_valid_checkpoint, load_checkpoint, save_checkpoint
    from megatron_triroute.inference.checkpoint import InferenceCheckpointError, load_inference_checkpoint

    from megatron_triroute.checkpoint.sharded import full_model_state

    step, tree, meta = load_checkpoint(trained)
    # The run wrote a layout-independent checkpoint; rebuild the earlier per-rank format from it.
    whole = full_model_state(latest_valid_checkpoint(trained).path / "sharded")
    meta = {k: v for k, v in meta.items() if k != "checkpoint_format"}
    tree = {"model": whole}
    bad_layout = dict(meta, layout=dict(meta["layout"], tp=2))
    save_checkpoint(tmp_path / "tp2", step, {"model": tree["model"]}, bad_layout)
    with pytest.raises(InferenceCheckpointError, match=r"tensor/pipeline/expert parallel \(2, 1, 1\)"):
        load_inference_checkpoint(tmp_path / "tp2")
    model = dict(tree["model"])
    del model["decoder.layers.1.self_attention.linear_proj.weight"]
    model["decoder.layers.0.stray.weight"] = torch.zeros(1)
    save_checkpoint(tmp_path / "missing", step, {"model": model}, meta)
    with pytest.raises(InferenceCheckpointError, match="missing decoder.layers.1.self_attention.linear_proj.weight") as err:
        load_inference_checkpoint(tmp_path / "missing")
    assert "decoder.layers.0.stray.weight" in str(err.value)
    shaped = dict(tree["model"], **{"output_layer.weight": torch.zeros(3, 3)})
    save_checkpoint(tmp_path / "shape", step, {"model": shaped}, meta)
    with pytest.raises(InferenceCheckpointError, match=r"output_layer.weight has shape \(3, 3\)"):
        load_inference_checkpoint(tmp_path / "shape")
    # A step directory is accepted as well as the root.
    info = latest_valid_checkpoint(trained)
    cfg, state = load_inference_checkpoint(info.path)
    assert "layers.0.wq" in state and cfg["triroute"]["model"]["n_layers"] == 2


def test_a_checkpoint_that_cannot_be_used_exits_2_with_one_line(tmp_path, capsys):
    from megatron_triroute import generate

    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)  # a step directory with no manifest
    assert generate.main(["--checkpoint", str(tmp_path / "checkpoints" / "step_00000002"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "manifest.json is missing" in err and "Traceback" not in err
