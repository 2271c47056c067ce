"""A Hugging Face home of the process's own, offline, for the test modules that load an export.

transformers reads its module cache's path when it is imported, so `isolate_hf_home` runs before
that import: HF_HOME and the remote-code modules cache go to a temporary directory that the process
removes at exit (each process that calls it, spawned ranks included, its own), and the hub,
transformers and datasets are switched offline.
"""

import atexit
import os
import shutil
import sys
import tempfile

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}


def isolate_hf_home(even_if_imported: bool = False) -> None:
    """The module doc's home, unless transformers is already imported (then its home stays, as its
    cache path already does) and `even_if_imported` is False; offline in every case."""
    if even_if_imported or "transformers" not in sys.modules:
        home = tempfile.mkdtemp(prefix="hf_home_")
        atexit.register(shutil.rmtree, home, ignore_errors=True)
        os.environ.update(HF_HOME=home, HF_MODULES_CACHE=os.path.join(home, "modules"))
    os.environ.update(OFFLINE)
