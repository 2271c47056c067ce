"""benchmarks/bench_checkpoint.py runs end to end at the tiny recipe (one blocking + async round) and
reports every figure it documents as a measured median with its range."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEYS = ("step_quiet_s", "step_during_write_s", "resume_s", "async_stall_over_blocking")


def test_one_round_at_the_tiny_recipe(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/bench_checkpoint.py", "--recipe", "tiny", "--rounds", "1",
                          "--root", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.rindex("\n{\n") + 1 :])  # the summary after the per-round lines
    for key in KEYS:
        median, lo, hi = map(float, re.fullmatch(r"([\d.]+) \[([\d.]+), ([\d.]+)\]", result[key]).groups())
        assert 0 < lo <= median <= hi, (key, result[key])
