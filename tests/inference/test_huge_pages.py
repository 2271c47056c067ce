"""The serving model's weights on huge pages: the same values in one 2 MiB-aligned buffer the
kernel was asked to back with huge pages, the same decode, and nothing moved where the kernel
offers none."""

import sys

import pytest
import torch
from torch import nn

from megatron_triroute.inference import huge_pages
from megatron_triroute.inference.huge_pages import (HUGE_PAGE, huge_page_copies, huge_pages_available,
                                                    place_on_huge_pages, thp_mode)

needs_thp = pytest.mark.skipif(not huge_pages_available(),
                               reason="the kernel offers no transparent huge pages here (not Linux, or mode never)")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert thp_mode(setting) == "madvise"
    setting.write_text("[always] madvise never\n")
    assert thp_mode(setting) == "always"
    assert thp_mode(tmp_path / "absent") is None


@needs_thp
def test_parameters_move_into_one_advised_buffer_with_their_values():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 768, bias=False), nn.LayerNorm(768))
    model[1].weight.data = model[1].weight.data.half()  # a second dtype in the same buffer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = place_on_huge_pages(model, min_bytes=1 << 20)  # the two weights (2 MiB and 1.5 MiB), not the rest
    assert moved == 512 * 1024 * 4 + 1024 * 768 * 2
    params = dict(model.named_parameters())
    for name, value in before.items():
        assert params[name].dtype == value.dtype and torch.equal(params[name], value), name
    big = [params["0.weight"], params["1.weight"]]
    assert big[0].untyped_storage().data_ptr() == big[1].untyped_storage().data_ptr()  # one buffer
    assert big[0].data_ptr() % HUGE_PAGE == 0 and big[1].data_ptr() % 64 == 0
    assert params["0.bias"].untyped_storage().data_ptr() != big[0].untyped_storage().data_ptr()  # too small: stays
    if sys.platform.startswith("linux"):
        assert "hg" in _vm_flags(big[0].data_ptr())  # MADV_HUGEPAGE took effect on the range


@needs_thp
def test_huge_page_copies_keep_values_and_are_writable():
    a, b = torch.randn(3, 5, 7), torch.arange(11, dtype=torch.int64)
    ca, cb = huge_page_copies([a, b])
    assert torch.equal(ca, a) and torch.equal(cb, b) and ca.data_ptr() != a.data_ptr()
    ca.zero_()
    assert torch.equal(cb, b) and a.abs().sum() > 0  # views of one buffer that do not overlap


def test_nothing_moves_where_the_kernel_offers_no_huge_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda setting=None: "never")
    model = nn.Linear(1024, 1024)
    pointer = model.weight.data_ptr()
    assert place_on_huge_pages(model, min_bytes=0) == 0 and model.weight.data_ptr() == pointer
    t = torch.ones(4)
    assert huge_page_copies([t])[0] is t


@needs_thp
def test_decode_steps_on_placed_weights_equal_the_unplaced_model():
    """The engine's model (every parameter moved, whatever its size) prefills and decodes the same
    logits, step by step."""
    from tests.inference.test_decode_step import decode_steps
    from tests.inference.test_engine import tiny_model

    models = [tiny_model(seed=3) for _ in range(2)]
    assert place_on_huge_pages(models[1], min_bytes=0) == sum(p.numel() * p.element_size()
                                                              for p in models[1].parameters())
    for (a, _), (b, _) in zip(decode_steps(models[0], 4), decode_steps(models[1], 4)):
        assert torch.equal(a, b)


def test_the_checkpoint_loader_places_the_weights_it_loaded(monkeypatch):
    """`inference.checkpoint.build_model` (the model generate, evaluate and lm-eval serve) hands its
    loaded model to `place_on_huge_pages`."""
    from megatron_triroute.inference.checkpoint import build_model
    from tests.inference.test_engine import tiny_model

    source, placed = tiny_model(seed=1), []
    monkeypatch.setattr(huge_pages, "place_on_huge_pages", lambda model: placed.append(model) or 0)
    model = build_model({"triroute": source.config.to_dict()}, dict(source.state_dict()), 0)
    assert placed == [model]
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), model.state_dict().values()))


@needs_thp
def test_each_parameter_lets_its_old_storage_go_before_the_next_is_copied(monkeypatch):
    """The process holds the weights about once while they move, not twice: when a parameter's copy
    is made, every earlier parameter's old tensor is already freed."""
    from torch.multiprocessing.reductions import StorageWeakRef

    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
    old = [StorageWeakRef(p.untyped_storage()) for p in model.parameters()]
    alive_at_copy = []
    views = huge_pages._views

    def watched(specs):
        for i, view in enumerate(views(specs)):
            alive_at_copy.append([not ref.expired() for ref in old[:i]])
            yield view

    monkeypatch.setattr(huge_pages, "_views", watched)
    assert not any(ref.expired() for ref in old)
    assert place_on_huge_pages(model, min_bytes=0) == 4 * 64 * 64 * 4
    assert alive_at_copy == [[], [False], [False, False], [False, False, False]]
    assert all(ref.expired() for ref in old)


@needs_thp
def test_a_parameter_that_shares_its_storage_stays_where_it_is():
    """Two parameters that are views of one tensor keep sharing it (a copy each would end that)."""
    flat = torch.randn(2, 1024, 512)
    model = nn.Module()
    model.a, model.b = nn.Parameter(flat[0]), nn.Parameter(flat[1])
    model.c = nn.Parameter(torch.randn(1024, 512))
    assert place_on_huge_pages(model, min_bytes=0) == 1024 * 512 * 4  # c alone
    assert model.a.data_ptr() == flat[0].data_ptr() and model.b.data_ptr() == flat[1].data_ptr()
    assert model.c.data_ptr() % HUGE_PAGE == 0
