"""Without Slurm binaries the cluster fixture skips on a workstation but fails in CI."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TARGET = "tests/slurm/test_cluster.py::test_nodelist_expansion_agrees_with_scontrol"


@pytest.mark.parametrize("ci, outcome", [("true", "1 error"), ("", "1 skipped")])
def test_missing_binaries_skip_only_outside_ci(ci, outcome):
    # PATH without the Slurm client tools (the fixture also searches /usr/sbin, where only daemons live).
    environ = {"PATH": "/nonexistent", "CI": ci, "HOME": str(Path.home())}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", TARGET],
        cwd=REPO, env=environ, capture_output=True, text=True, timeout=120,
    )
    assert outcome in done.stdout, done.stdout + done.stderr
    assert "Slurm binaries not found" in done.stdout
    assert (done.returncode != 0) == (ci == "true")
