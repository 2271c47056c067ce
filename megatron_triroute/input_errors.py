"""Bad input as one exception type, and the one place a command line turns it into exit status 2.

Every error whose cause is what the user gave (a config value, a recipe name, a checkpoint, an
export, a data directory) derives from `InputError` and names the file or field and the fix:
`ConfigError`, `CheckpointError`, `InferenceCheckpointError`, `EvaluationSetupError`,
`ExportError`. A command line's `main` is wrapped in `reports_input_errors`, which prints such an
error as one `error: ...` line on stderr and returns 2 (no traceback); anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

INPUT_ERROR_STATUS = 2
"""Exit status of a command line refused for its input (argparse's own status for usage errors)."""


class InputError(Exception):
    """What the user gave cannot be used; the message names it and the fix."""


def reports_input_errors(main: Callable[..., int]) -> Callable[..., int]:
    """`main` with an `InputError` (or a missing file the user named) reported as one line on stderr
    and exit status 2."""

    @functools.wraps(main)
    def guarded(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except (InputError, FileNotFoundError) as error:
            print(f"error: {error}", file=sys.stderr)
            return INPUT_ERROR_STATUS

    return guarded
