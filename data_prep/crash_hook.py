"""A test hook that kills the process mid-shard, to prove resumes are exact.

Set `DATA_PREP_CRASH_AFTER=<stage>:<shard file name>:<N>` (stage `parse` or `tokenize`) and the
process handling that shard calls `os._exit(CRASH_EXIT_CODE)` after its N-th record: no cleanup,
no flush, exactly like a SIGKILL or a node failure. Unset (always, outside tests) it costs one
comparison per record.
"""

from __future__ import annotations

import os
from typing import Optional

CRASH_ENV = "DATA_PREP_CRASH_AFTER"
CRASH_EXIT_CODE = 86


def crash_limit(stage: str, shard_path: str) -> Optional[int]:
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return None
    if spec.count(":") < 2:
        raise ValueError(f"{CRASH_ENV}={spec!r}: expected <stage>:<shard file name>:<N>")
    want_stage, rest = spec.split(":", 1)
    name, count = rest.rsplit(":", 1)
    if want_stage == stage and os.path.basename(shard_path.rstrip("/")) == name:
        return int(count)
    return None


def crash_now() -> None:
    os._exit(CRASH_EXIT_CODE)
