"""The export loads with `trust_remote_code=True` where megatron_triroute, megatron and
deepspeed cannot be imported, and batched generation with padding gives each prompt what it
gets alone (greedy and seeded sampling)."""

import json
import os
import subprocess
import sys

import pytest

from tests.export.helpers import engine_model

CODE = r"""
import importlib.abc, importlib.util, json, sys
BLOCKED = ("megatron_triroute", "megatron", "deepspeed")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError("blocked: " + name, name=name)
sys.meta_path.insert(0, Block())
# As where they are not installed: probing for them finds nothing (transformers probes for deepspeed
# when accelerate is installed) and importing them fails.
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if name.split(".")[0] in BLOCKED else _find_spec(name, package)
sys.path = [p for p in sys.path if p not in ("", ".")]
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
prompts = ["The history of the", "A", "def main():\n    x = 1"]
out = {}
for sample in (False, True):
    batch = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    together = model.generate(**batch, max_new_tokens=10, do_sample=sample, top_p=0.9 if sample else None,
                              temperature=0.8 if sample else None)
    width = batch["input_ids"].shape[1]
    rows = [together[b, width:].tolist() for b in range(len(prompts))]
    alone = []
    for p in prompts:
        ids = tok(p, return_tensors="pt")
        torch.manual_seed(0)
        alone.append(model.generate(**ids, max_new_tokens=10, do_sample=sample, top_p=0.9 if sample else None,
                                    temperature=0.8 if sample else None)[0, ids["input_ids"].shape[1]:].tolist())
    out["sample" if sample else "greedy"] = {"together": rows, "alone": alone}
out["heavy"] = sorted(m for m in sys.modules if m.split(".")[0] in ("megatron_triroute", "megatron", "deepspeed"))
out["module"] = type(model).__module__
print(json.dumps(out))
"""


def _trim(tokens, eod):
    return tokens[: tokens.index(eod) + 1] if eod in tokens else tokens


@pytest.mark.distributed
def test_loads_without_the_project_and_batches_with_padding(checkpoints, exports, tmp_path):
    env = dict(os.environ, PYTHONPATH="", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CODE, str(exports["tp2"])], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [] and result["module"].startswith("transformers_modules.")
    engine, eod = engine_model(checkpoints["tp2"])
    greedy = result["greedy"]
    # Padding: each prompt continues as it does alone (up to its EOD; after it HF pads).
    assert [_trim(t, eod) for t in greedy["together"]] == [_trim(t, eod) for t in greedy["alone"]]
    # Greedy equals the engine's own greedy decode of the same prompt ids.
    from megatron_triroute.inference.engine import InferenceEngine
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(exports["tp2"] / "tokenizer.model"))
    for prompt, tokens in zip(["The history of the", "A", "def main():\n    x = 1"], greedy["alone"]):
        request = InferenceEngine(engine).run([sp.encode(prompt)], 10, stop_token=eod)[0]
        assert request.generated == _trim(tokens, eod), prompt
    sample = result["sample"]
    assert all(len(t) == 10 or eod in t for t in sample["alone"])


@pytest.mark.distributed
def test_no_project_module_in_the_export(exports):
    """Every file of the export imports only the standard library, torch, transformers and its
    own flat siblings (a second check beside the subprocess above, on the source itself)."""
    import ast

    allowed = set(sys.stdlib_module_names) | {"torch", "transformers"}
    for path in exports["tp2"].glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] in allowed, (path.name, node.module)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 1 and (exports["tp2"] / f"{node.module}.py").is_file(), (path.name, node.module)
            elif isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] in allowed for a in node.names), path.name


def test_copier_flattens_project_imports_and_leaves_out_optional_kernels(tmp_path):
    """A synthetic project: relative and absolute project imports are flattened; a module imported
    only inside `try:` whose own imports need a missing package is left out and its `try` falls back;
    a required foreign import is refused naming it."""
    import importlib
    import textwrap

    from megatron_triroute.export.remote_code import RemoteCodeError, remote_code_files

    def write(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))

    pkg, kern = tmp_path / "src" / "pkg", tmp_path / "src" / "kern"
    write(pkg / "__init__.py", "")
    write(kern / "__init__.py", "")
    write(pkg / "inference" / "model.py", """\
        from __future__ import annotations
        import math
        from ..config import (
            WIDTH,
        )
        from kern.ops import double

        def run(x):
            from .helper import plus_one
            return plus_one(double(x)) + WIDTH + int(math.sqrt(4))
        """)
    write(pkg / "inference" / "helper.py", "def plus_one(x):\n    return x + 1\n")
    write(pkg / "config.py", "WIDTH = 10\n")
    write(kern / "ops.py", """\
        try:
            from .fast import double
        except ImportError:
            def double(x):
                return 2 * x
        """)
    write(kern / "fast.py", "import not_a_real_gpu_package\ndouble = None\n")
    roots = {"pkg": (pkg, "tr"), "kern": (kern, "tk")}
    files = remote_code_files(roots, pkg / "inference" / "model.py")
    assert sorted(f for f in files if f.startswith("t")) == [
        "tk_ops.py", "tokenization_triroute.py", "tr_config.py", "tr_inference_helper.py", "tr_inference_model.py"]
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "__init__.py").write_text("")
    for name, source in files.items():
        if name.startswith(("tr_", "tk_")):
            (flat / name).write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        assert importlib.import_module("flat.tr_inference_model").run(3) == 3 * 2 + 1 + 10 + 2
    finally:
        sys.path.remove(str(tmp_path))
    write(pkg / "config.py", "import not_a_real_gpu_package\nWIDTH = 10\n")
    with pytest.raises(RemoteCodeError, match=r"config.py imports \['not_a_real_gpu_package'\]"):
        remote_code_files(roots, pkg / "inference" / "model.py")
