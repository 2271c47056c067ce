"""`no_grad_command`: the body runs without autograd and gets argv; the caller's autograd state is
kept, also when the body raises; an input error becomes one stderr line and status 2."""

import pytest
import torch

from megatron_triroute.command import no_grad_command
from megatron_triroute.input_errors import INPUT_ERROR_STATUS, InputError


def test_the_body_runs_without_autograd_and_the_caller_keeps_it(capsys):
    seen = []

    def body(argv):
        seen.append((argv, torch.is_grad_enabled()))
        return 7

    main = no_grad_command(body)
    assert torch.is_grad_enabled()
    assert main(["--x"]) == 7 and main() == 7
    assert seen == [(["--x"], False), (None, False)]
    assert torch.is_grad_enabled()

    def refused(argv):
        raise InputError("the checkpoint is gone. Fix: name another")

    assert no_grad_command(refused)([]) == INPUT_ERROR_STATUS
    assert capsys.readouterr().err == "error: the checkpoint is gone. Fix: name another\n"
    assert torch.is_grad_enabled()

    def bug(argv):
        raise RuntimeError("a bug keeps its traceback")

    with pytest.raises(RuntimeError, match="a bug"):
        no_grad_command(bug)([])
    assert torch.is_grad_enabled()
