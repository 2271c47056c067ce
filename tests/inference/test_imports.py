"""The engine is shippable modeling code: importing and running it loads neither Megatron nor DeepSpeed."""

import subprocess
import sys

CODE = """
import sys, torch
import megatron_triroute.inference.model, megatron_triroute.inference.engine, megatron_triroute.inference.checkpoint
from megatron_triroute.config import TriRouteConfig
from megatron_triroute.inference.engine import InferenceEngine
from megatron_triroute.inference.model import InferenceModel
cfg = TriRouteConfig()
cfg.model.vocab_size, cfg.router.d_router = 32, 16
InferenceEngine(InferenceModel(cfg.validate())).run([[1, 2, 3]], 2)
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'deepspeed', 'transformer_engine', 'apex'))
assert not heavy, heavy
"""


def test_engine_imports_only_torch_and_the_routing_core():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
