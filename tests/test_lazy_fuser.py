"""megatron_triroute.lazy_fuser: Megatron-Core's fusion functions are compiled at their first call,
by the real torch.compile with the same options, and importing Megatron-Core through this package no
longer imports TorchDynamo or Inductor."""

import subprocess
import sys
import textwrap
from pathlib import Path

from megatron_triroute.lazy_fuser import deferred_compile

REPO = Path(__file__).resolve().parents[1]


class RecordingCompile:
    """A stand-in for torch.compile: records its calls and returns a doubling wrapper."""

    def __init__(self):
        self.calls = []

    def __call__(self, fn, **kwargs):
        self.calls.append((fn, kwargs))
        return lambda *a, **k: 2 * fn(*a, **k)


def test_a_function_is_compiled_once_at_its_first_call_with_the_same_options():
    real = RecordingCompile()
    compile_ = deferred_compile(real)

    def add(a, b=1):
        return a + b

    plain = compile_(add)
    with_options = compile_(dynamic=False, backend="inductor")(add)
    assert real.calls == []  # nothing compiled by the decoration
    assert plain.__name__ == "add" and plain.__wrapped__ is add
    assert plain(3) == 8 and plain(3, b=2) == 10  # the compiled function runs, from the first call on
    assert with_options(1) == 4
    assert real.calls == [(add, {}), (add, {"dynamic": False, "backend": "inductor"})]  # once each


def test_anything_but_a_plain_function_is_compiled_at_once():
    real = RecordingCompile()

    class Module:
        def __call__(self, x):
            return x

    module = Module()
    deferred_compile(real)(module, mode="max-autotune")
    assert real.calls == [(module, {"mode": "max-autotune"})]


def test_megatron_core_imports_without_inductor_and_its_fusions_compile_when_called():
    script = textwrap.dedent("""
        import sys
        import torch

        calls = []
        def recording_compile(fn, **kwargs):  # stands in for torch.compile (no Inductor build)
            calls.append(fn.__name__)
            return fn
        torch.compile = recording_compile

        import megatron_triroute  # installs the deferral
        import megatron.core
        from megatron.core import jit
        from megatron.core.fusions.fused_bias_gelu import bias_gelu
        assert "torch._inductor" not in sys.modules, "Megatron-Core's import pulled in Inductor"
        assert jit.jit_fuser is not recording_compile and calls == []
        assert "jit_fuser" in jit.__spec__.loader.get_source(jit.__name__)  # the file's loader still answers
        bias, y = torch.randn(8), torch.randn(4, 8)
        x = bias + y
        want = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
        torch.testing.assert_close(bias_gelu(bias, y), want)
        bias_gelu(bias, y)
        assert calls == ["bias_gelu"], calls  # compiled by the real compile, once, at the first call
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
