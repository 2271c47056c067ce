"""The `main` of a command line that runs a model without training it (`generate`, `evaluate`,
`analyze`): input errors reported as one line and exit status 2 (`input_errors`), autograd off for
the call only (a caller in the same process, a test or a notebook, keeps its own state), torch
imported at the first call (`--help` stays fast)."""

from __future__ import annotations

import functools
from typing import Callable

from .input_errors import reports_input_errors


def no_grad_command(body: Callable[..., int]) -> Callable[..., int]:
    """`main(argv=None)` running `body(argv)` under `torch.no_grad()`, its input errors reported."""

    @reports_input_errors
    @functools.wraps(body)
    def main(argv=None) -> int:
        import torch

        with torch.no_grad():
            return body(argv)

    return main
