import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _autograd_state_is_not_leaked():
    """A test (or an in-process CLI it calls) that switches autograd off for the whole process makes
    every later test that trains fail far from the cause: fail here, at the test that leaked it."""
    import torch

    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("autograd was left disabled for the process (scope torch.no_grad() to the call)")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """The tiny data_prep output (300 documents, a 1000-piece tokenizer), built once for the whole run."""
    root = tmp_path_factory.mktemp("tiny_data")
    py = sys.executable
    subprocess.run([py, "-m", "data_prep", "corpus", "--output", str(root / "corpus"), "--max-docs", "300"],
                   check=True, cwd=REPO, capture_output=True)
    subprocess.run([py, "-m", "data_prep", "build", "--input", str(root / "corpus" / "*.jsonl.zst"),
                    "--output", str(root / "data"), "--vocab-size", "1000", "--workers", "1"],
                   check=True, cwd=REPO, capture_output=True)
    return root / "data"
