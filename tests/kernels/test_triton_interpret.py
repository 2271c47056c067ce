"""Runs tests/kernels/interpret_cases.py in a subprocess with TRITON_INTERPRET=1 (the Triton
kernels execute on CPU there). Triton is a test dependency: a missing install fails here."""

import os
import subprocess
import sys
from pathlib import Path

import triton  # noqa: E402,F401  (the test extra installs it)

ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", TRIROUTE_KERNELS="auto")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).with_name("interpret_cases.py"))]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout, res.stdout[-2000:]
