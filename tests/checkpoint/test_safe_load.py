"""Sharded checkpoint loads: torch DCP's `.metadata` is read only through the allow-list, `common.pt`
only with `weights_only=True`, and a truncated data file is refused by name (one process)."""

import pickle
import shutil

import pytest

from megatron_triroute.checkpoint import CheckpointError

RAN = []
"""What a pickled payload executed when unpickled (it must stay empty)."""


def _record(what):
    RAN.append(what)
    return {}


class _Payload:
    """An object whose unpickling calls `_record`: what a hostile checkpoint file would carry."""

    def __reduce__(self):
        return (_record, ("unpickled",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the config, a model's `sharded/` directory) of a tiny TriRoute model (one process)."""
    from megatron_triroute.checkpoint.sharded import save_model
    from megatron_triroute.config import TriRouteConfig
    from megatron_triroute.distributed.one_process import build_model, single_process_parallel

    cfg = TriRouteConfig().validate()
    directory = tmp_path_factory.mktemp("safe_load") / "sharded"
    with single_process_parallel() as groups:
        save_model(directory, build_model(cfg, groups))
    return cfg, directory


def _load(cfg, directory):
    from megatron_triroute.checkpoint.sharded import load_model
    from megatron_triroute.distributed.one_process import build_model, single_process_parallel

    with single_process_parallel() as groups:
        load_model(directory, build_model(cfg, groups, seed=7))


def _copy(saved, tmp_path):
    shutil.copytree(saved[1], tmp_path / "sharded")
    return tmp_path / "sharded"


def test_a_truncated_data_file_is_refused_naming_it(saved, tmp_path):
    from megatron_triroute.checkpoint.sharded import full_model_state

    directory = _copy(saved, tmp_path)
    data = sorted(directory.glob("*.distcp"))[-1]
    with open(data, "r+b") as handle:
        handle.truncate(data.stat().st_size // 2)
    for load in (lambda: full_model_state(directory), lambda: _load(saved[0], directory)):
        with pytest.raises(CheckpointError, match=rf"{data.name} is \d+ bytes, but .* truncated\. Fix: copy"):
            load()


def test_the_loads_never_unpickle_metadata_freely(saved, tmp_path, monkeypatch):
    """torch's own `FileSystemReader.read_metadata` is `pickle.load`: made to fail, both loads still
    work (they read the metadata through the allow-list); a forbidden global is refused by them."""
    import torch.distributed.checkpoint.filesystem as filesystem

    from megatron_triroute.checkpoint.sharded import full_model_state

    class NoFreeUnpickle:
        def __getattr__(self, name):
            if name in ("load", "loads", "Unpickler"):
                raise AssertionError(f"torch DCP called pickle.{name} on checkpoint metadata")
            return getattr(pickle, name)

    monkeypatch.setattr(filesystem, "pickle", NoFreeUnpickle())
    cfg, directory = saved
    assert full_model_state(directory)
    _load(cfg, directory)
    hostile = _copy(saved, tmp_path)
    (hostile / ".metadata").write_bytes(pickle.dumps(_Payload()))
    for load in (lambda: full_model_state(hostile), lambda: _load(cfg, hostile)):
        with pytest.raises(CheckpointError, match="_record, which is not on the allow-list"):
            load()
    assert RAN == []


def test_common_state_is_loaded_weights_only(saved, tmp_path, monkeypatch):
    """Even where torch's default is a full unpickle (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD), a common.pt
    holding an arbitrary object is refused and nothing in it runs."""
    import torch

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    directory = _copy(saved, tmp_path)
    torch.save({"payload": _Payload()}, directory / "common.pt")
    with pytest.raises(CheckpointError, match=r"common.pt holds more than tensors .* refusing to unpickle it"):
        _load(saved[0], directory)
    assert RAN == []
