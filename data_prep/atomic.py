"""Crash-safe file writing for the data pipeline.

The primitives (atomic writes, directory publish with no window where neither the old nor the new
directory exists, fsync, checksums) live in `megatron_triroute.durability`, shared with the
checkpoint store; this module re-exports them under the names data_prep uses and adds the one
format helper only data_prep needs (numpy arrays).
"""

from __future__ import annotations

import io
from pathlib import Path

from megatron_triroute.durability import (  # noqa: F401  (re-exported)
    TMP_MARK,
    fsync_dir,
    fsync_file,
    publish_dir,
    publish_file,
    recover_dir,
    remove_stale_tmp,
    sha256_file,
    tmp_path_for,
    write_bytes_atomic,
    write_json_atomic,
)


def write_npy_atomic(path: Path, array) -> None:
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array)
    write_bytes_atomic(path, buffer.getvalue())
