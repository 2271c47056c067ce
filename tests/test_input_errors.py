"""Bad input is one exception type that every command line reports as one line and exit status 2."""

import pytest


def test_every_bad_input_error_is_an_input_error():
    from megatron_triroute.checkpoint import CheckpointError
    from megatron_triroute.config import ConfigError
    from megatron_triroute.evaluation.loading import EvaluationSetupError
    from megatron_triroute.export.completeness import ExportError
    from megatron_triroute.inference.checkpoint import InferenceCheckpointError
    from megatron_triroute.input_errors import InputError

    for error in (ConfigError, CheckpointError, EvaluationSetupError, ExportError, InferenceCheckpointError):
        assert issubclass(error, InputError), error


def test_reports_input_errors_prints_one_line_and_returns_2(capsys):
    from megatron_triroute.config import ConfigError
    from megatron_triroute.input_errors import reports_input_errors

    @reports_input_errors
    def main(argv=None):
        if argv == ["bad"]:
            raise ConfigError("train.steps='x': not an integer. Fix: give one")
        if argv == ["bug"]:
            raise KeyError("a bug keeps its traceback")
        return 0

    assert main([]) == 0
    assert main(["bad"]) == 2
    assert capsys.readouterr().err == "error: train.steps='x': not an integer. Fix: give one\n"
    with pytest.raises(KeyError):
        main(["bug"])
