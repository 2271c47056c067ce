"""Helpers for the data_prep tests: run the CLI in-process or as a subprocess, read outputs.

(A uniquely named module, not conftest.py, so `from dp_helpers import ...` can never pick up
another directory's conftest.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import zstandard

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "data_prep"
TINY_VOCAB = ["--vocab-size", "400"]


def build(output: Path, inputs: list, *extra: str, command: str = "build") -> int:
    """`python -m data_prep <command>` in this process (imports are paid once per test session)."""
    from data_prep.__main__ import main

    args = [command, "--output", str(output)]
    for item in inputs:
        args += ["--input", str(item)]
    return main(args + list(extra))


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI in a child process (needed where the process must die, e.g. the crash hook)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "data_prep", *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=300)


def output_bytes(output: Path) -> dict[str, bytes]:
    """Every final output file (datasets, tokenizer, tables, rejects, summary) by relative path."""
    wanted = []
    for pattern in ("*.bin", "*.idx", "buckets/*", "tokenizer/*", "rejects.jsonl", "summary.json"):
        wanted.extend(output.glob(pattern))
    return {str(p.relative_to(output)): p.read_bytes() for p in sorted(wanted) if p.is_file()}


def read_dataset(prefix: Path) -> list[np.ndarray]:
    from data_prep.megatron_io import open_dataset

    dataset = open_dataset(prefix)
    return [np.array(dataset[i]) for i in range(len(dataset))]


def summary(output: Path) -> dict:
    return json.loads((output / "summary.json").read_text())


def read_jsonl_zst(path: Path) -> list[dict]:
    data = zstandard.ZstdDecompressor().stream_reader(path.read_bytes(), read_across_frames=True).read()
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


CORPUS_OPTIONS = (*TINY_VOCAB, "--valid-fraction", "0.2", "--long-context-tokens", "600")
"""Options every build of `small_corpus` uses, so its outputs compare with `corpus_reference`."""
