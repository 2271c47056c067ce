"""Export of checkpoints saved at TP=2, EP=2 and PP=2: the Hugging Face model's logits equal the
engine's, greedy generation and the realised cost equal `megatron_triroute.generate`'s, every
expert is present under its global id, and incomplete checkpoints are refused with nothing written."""

import hashlib
import json
import pickle
import shutil

import pytest
import torch

from tests.export.helpers import engine_logits, engine_model, left_pad, sequences

pytestmark = pytest.mark.distributed  # the checkpoints fixture spawns two gloo ranks


def _hf(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)


@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2"])
def test_logits_equal_the_engine(checkpoints, exports, layout):
    engine, eod = engine_model(checkpoints[layout])
    hf = _hf(exports[layout])
    assert type(hf).__name__ == "TriRouteForCausalLM" and hf.dtype == torch.float32
    seqs = sequences(engine.config.model.vocab_size, eod)
    ids, mask = left_pad(seqs, eod)
    with torch.no_grad():
        got = hf(input_ids=ids, attention_mask=mask).logits
    n = ids.shape[1]
    taken: dict = {}
    for b, seq in enumerate(seqs):
        want = engine_logits(engine, seq, taken)
        err = (got[b, n - len(seq):] - want).abs().max().item()
        assert err < 1e-4, (layout, b, err)
    assert taken["modes"] == {0, 1, 2} and len(taken["bits"]) >= 2, taken  # the paths the batch exercises
    # Right padding gives the same values at the valid positions.
    right = torch.full_like(ids, eod)
    rmask = torch.zeros_like(mask)
    for b, seq in enumerate(seqs):
        right[b, : len(seq)], rmask[b, : len(seq)] = torch.tensor(seq), 1
    with torch.no_grad():
        again = hf(input_ids=right, attention_mask=rmask).logits
    for b, seq in enumerate(seqs):
        assert torch.equal(again[b, : len(seq)], got[b, n - len(seq):]), b


def test_greedy_generation_and_cost_equal_generate_cli(tiny_data, checkpoints, tmp_path, capsys):
    """The export CLI, then `megatron_triroute.generate`'s CLI (both in this process: same code path,
    without paying the imports twice) against Hugging Face `generate`."""
    from transformers import AutoTokenizer

    from megatron_triroute import generate
    from megatron_triroute.export.__main__ import main as export_main

    out_dir = tmp_path / "hf"
    assert export_main(["--checkpoint", str(checkpoints["ep2"]), "--output", str(out_dir)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out_dir)
    assert "complete:" in captured.err and "exported" in captured.err  # progress lines
    prompt = "The history of the"
    assert generate.main(["--checkpoint", str(checkpoints["ep2"]), "--prompt", prompt, "--max-new-tokens", "32",
                          "--json"]) == 0
    assert torch.is_grad_enabled()  # generate.main runs without autograd only inside itself
    want = json.loads(capsys.readouterr().out)
    tok = AutoTokenizer.from_pretrained(out_dir, trust_remote_code=True)
    hf = _hf(out_dir)
    ids = tok(prompt, return_tensors="pt")
    out = hf.generate(**ids, max_new_tokens=32, do_sample=False, return_dict_in_generate=True)
    new = out.sequences[0, ids["input_ids"].shape[1]:].tolist()
    eod = hf.config.eod_token_id
    if eod in new:
        new = new[: new.index(eod)]
    assert new == want["token_ids"] and len(new) >= 8
    cost = hf.realised_cost(out.past_key_values)
    assert cost["realised_flops"] == want["realised_flops"] and cost["realised_mem"] == want["realised_mem"]


def _reference_experts(root, name):
    from safetensors.torch import load_file

    ref = {}
    for file in sorted(root.glob(f"{name}_experts_rank*.safetensors")):
        part = load_file(str(file))
        assert not set(part) & set(ref)
        ref.update(part)
    return ref


def test_every_expert_present_under_its_global_id(checkpoints, exports):
    from megatron_triroute.export.safetensors_io import read_weights

    weights = read_weights(exports["ep2"])
    ref = _reference_experts(checkpoints["root"], "ep2")
    layers, experts = 2, 4
    assert len(ref) == layers * experts * 3  # both ranks' experts, by global id
    for key, value in ref.items():
        layer, e, w = key.split(".")
        assert torch.equal(weights[f"model.layers.{layer}.experts.{e}.{w}.weight"], value), key
    for layer in range(layers):
        w1 = [weights[f"model.layers.{layer}.experts.{e}.w1.weight"] for e in range(experts)]
        assert all(not torch.equal(w1[i], w1[j]) for i in range(experts) for j in range(i + 1, experts))


def test_ep4_export_equals_the_engine_and_holds_every_expert(ep4_checkpoint, tmp_path):
    """Four expert-parallel ranks of one expert each: the export holds each under its global id."""
    from megatron_triroute.export.exporter import export
    from megatron_triroute.export.safetensors_io import read_weights

    out = export(ep4_checkpoint / "ep4", tmp_path / "hf")
    weights = read_weights(out)
    ref = _reference_experts(ep4_checkpoint, "ep4")
    assert len(ref) == 2 * 4 * 3
    for key, value in ref.items():
        layer, e, w = key.split(".")
        assert torch.equal(weights[f"model.layers.{layer}.experts.{e}.{w}.weight"], value), key
    engine, eod = engine_model(ep4_checkpoint / "ep4")
    seqs = sequences(engine.config.model.vocab_size, eod)
    ids, mask = left_pad(seqs, eod)
    with torch.no_grad():
        got = _hf(out)(input_ids=ids, attention_mask=mask).logits
    for b, seq in enumerate(seqs):
        err = (got[b, ids.shape[1] - len(seq):] - engine_logits(engine, seq)).abs().max().item()
        assert err < 1e-4, (b, err)


def test_the_export_reads_the_model_once(checkpoints):
    """The exporter's read (`copy=False`) gives the same tensors as the engine's, as views into the
    stacked global tensors rather than per-layer clones (no second copy of the model); the engine's
    (`copy=True`) holds a copy of each layer's experts."""
    from megatron_triroute.inference.checkpoint import load_inference_checkpoint

    _, copied = load_inference_checkpoint(checkpoints["ep2"])
    _, viewed = load_inference_checkpoint(checkpoints["ep2"], copy=False)
    assert sorted(copied) == sorted(viewed) and all(torch.equal(copied[k], viewed[k]) for k in copied)
    experts = [viewed[f"layers.{layer}.experts.{e}.w1.weight"] for layer in range(2) for e in range(4)]
    assert len({t.untyped_storage().data_ptr() for t in experts}) == 1  # one stacked [layers, experts, ...] tensor
    assert len({copied[f"layers.{layer}.experts.{e}.w1.weight"].untyped_storage().data_ptr()
                for layer in range(2) for e in range(4)}) == 2  # a copy per layer, not the global tensor
    assert experts[0].untyped_storage().data_ptr() not in {
        copied[f"layers.{layer}.experts.0.w1.weight"].untyped_storage().data_ptr() for layer in range(2)}


def test_experts_gathered_under_local_ids_are_refused(checkpoints):
    """What last-writer-wins gathering produces (rank 1's local experts 0, 1 written over rank 0's,
    its slots 2, 3 holding copies) is refused before anything is written."""
    from megatron_triroute.config import TriRouteConfig
    from megatron_triroute.export.completeness import ExportError, check_complete
    from megatron_triroute.inference.checkpoint import load_inference_checkpoint

    tree, state = load_inference_checkpoint(checkpoints["ep2"])
    config = TriRouteConfig.from_dict(tree["triroute"])
    check_complete(config, state)
    broken = dict(state)
    for w in ("w1", "w2", "w3"):
        for e in (0, 1):
            broken[f"layers.1.experts.{e}.{w}.weight"] = state[f"layers.1.experts.{e + 2}.{w}.weight"]
    with pytest.raises(ExportError, match=r"layer 1: experts 0 and 2 are identical"):
        check_complete(config, broken)
    missing = {k: v for k, v in state.items() if not k.startswith("layers.1.experts.3.")}
    with pytest.raises(ExportError, match=r"missing layers\.1\.experts\.3\.w1\.weight"):
        check_complete(config, missing)


def test_non_finite_tensors_are_refused(checkpoints):
    """The finiteness check (minimum and maximum, no temporary of the tensor's size) finds NaN and
    +-inf anywhere, in strided views and in bf16, and names the tensor."""
    from megatron_triroute.config import TriRouteConfig
    from megatron_triroute.export.completeness import ExportError, check_complete, finite

    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    assert finite(base) and finite(base[:, 1::2]) and finite(torch.empty(0)) and finite(base.bfloat16())
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = base.clone()
        t[3, 5] = bad
        assert not finite(t) and not finite(t[:, 1::2]) and not finite(t.bfloat16())
        assert finite(t[:, :5])
    from megatron_triroute.inference.checkpoint import load_inference_checkpoint

    tree, state = load_inference_checkpoint(checkpoints["ep2"], copy=False)
    config = TriRouteConfig.from_dict(tree["triroute"])
    check_complete(config, state)
    wk = state["layers.1.wk"]  # a strided view into this read's own fused QKV tensor
    assert not wk.is_contiguous()
    wk[1, 0, 0] = float("nan")
    with pytest.raises(ExportError, match=r"layers\.1\.wk is not finite"):
        check_complete(config, state)


def test_missing_expert_shard_is_refused_and_nothing_written(checkpoints, tmp_path):
    from megatron_triroute.checkpoint.sharded import read_metadata
    from megatron_triroute.export.completeness import ExportError
    from megatron_triroute.export.exporter import export

    broken = tmp_path / "ckpt"
    shutil.copytree(checkpoints["ep2"], broken)
    sharded = next(broken.glob("step_*")) / "sharded"
    meta = read_metadata(sharded)
    key = sorted(k for k in meta.state_dict_metadata if ".moe.experts." in k)[0]
    meta.state_dict_metadata[key].chunks.pop()  # as if one expert-parallel rank's shard never got written
    data = pickle.dumps(meta)
    (sharded / ".metadata").write_bytes(data)
    # The commit went ahead anyway (its manifest describes what is there): only coverage can tell.
    manifest = json.loads((sharded.parent / "manifest.json").read_text())
    manifest["files"]["sharded/.metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (sharded.parent / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "out" / "hf"
    with pytest.raises(ExportError, match=r"moe\.experts.*Nothing was written"):
        export(broken, out)
    assert not out.exists() and not (tmp_path / "out").exists()


def test_missing_layer_is_refused_and_nothing_written(checkpoints, tmp_path):
    from megatron_triroute.checkpoint.sharded import full_model_state
    from megatron_triroute.checkpoint.store import latest_valid_checkpoint, load_checkpoint, save_checkpoint
    from megatron_triroute.export.completeness import ExportError
    from megatron_triroute.export.exporter import export

    source = checkpoints["pp2"]
    step, _, meta = load_checkpoint(source)
    whole = full_model_state(latest_valid_checkpoint(source).path / "sharded")
    meta = dict({k: v for k, v in meta.items() if k != "checkpoint_format"}, layout=dict(tp=1, pp=1, ep=1))
    save_checkpoint(tmp_path / "ckpt", step, {"model": {k: v for k, v in whole.items()
                                                        if not k.startswith("decoder.layers.1.")}}, meta)
    (tmp_path / "out").mkdir()
    with pytest.raises(ExportError, match=r"missing decoder\.layers\.1\.self_attention"):
        export(tmp_path / "ckpt", tmp_path / "out" / "hf")
    assert list((tmp_path / "out").iterdir()) == []


def test_sharded_output_with_index(checkpoints, exports, tmp_path):
    from safetensors import safe_open

    from megatron_triroute.export.exporter import export
    from megatron_triroute.export.safetensors_io import INDEX, read_weights

    out = export(checkpoints["tp2"], tmp_path / "hf", max_shard_size=40_000)
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) > 2 and (out / INDEX).is_file() and not (out / "model.safetensors").exists()
    index = json.loads((out / INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == files
    for file in files:
        with safe_open(str(out / file), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
    single, sharded = read_weights(exports["tp2"]), read_weights(out)
    assert sorted(single) == sorted(sharded) and all(torch.equal(single[k], sharded[k]) for k in single)
    hf = _hf(out)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        # The weights are equal bit for bit (above). The logits agree to the kernels' tolerance: an
        # exported module takes the C++ decode kernels when torch.ops.triroute already holds them in
        # this process at its first check, and the PyTorch twins otherwise.
        torch.testing.assert_close(hf(input_ids=ids).logits, _hf(exports["tp2"])(input_ids=ids).logits,
                                   rtol=0, atol=1e-5)


def test_bf16_storage_keeps_buffers(checkpoints, tmp_path):
    from megatron_triroute.export.exporter import export
    from megatron_triroute.export.safetensors_io import read_weights

    out = export(checkpoints["tp2"], tmp_path / "hf", dtype="bf16")
    weights = read_weights(out)
    assert weights["model.layers.0.wq"].dtype == torch.bfloat16
    assert weights["model.prices"].dtype == torch.float64 and weights["model.token_word_start"].dtype == torch.bool
    assert weights["model.token_log_prob"].dtype == torch.float32
    hf = _hf(out)  # computes in float32 whatever the storage
    assert hf.dtype == torch.float32 and hf(input_ids=torch.tensor([[5, 6, 7]])).logits.isfinite().all()


def test_existing_output_is_refused(exports, checkpoints):
    from megatron_triroute.export.completeness import ExportError
    from megatron_triroute.export.exporter import export

    with pytest.raises(ExportError, match="already exists"):
        export(checkpoints["tp2"], exports["tp2"])
