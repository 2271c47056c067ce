"""A decode step's decisions in one C++ call (`controller.decode_decisions`,
`torch.ops.triroute.decode_decisions`) against the tensor ops that define them: the eval
controller's argmax and `top_k_gating`, the priced argmax of `pricing._price_rows`, and
`decision_features` (psi's block for the next layer)."""

import dataclasses

import pytest
import torch

from benchmarks.op_counter import StepCounter
from megatron_triroute import TriRouteController
from megatron_triroute.routing import controller as controller_mod
from megatron_triroute.routing import pricing
from megatron_triroute.routing.controller import AxisDecision, decision_features
from megatron_triroute.routing.gumbel import one_hot
from megatron_triroute.routing.modes import N_MODES
from megatron_triroute.routing.pricing import price_shifts
from triroute_kernels import cpu_ops_available
from triroute_kernels.paged_ops import DECODE_LINEAR_ROWS

from .helpers import make_inputs, tiny_config


@pytest.fixture(autouse=True)
def _built():
    assert cpu_ops_available(), "the C++ kernels did not build here"


def _logits(cfg, ctrl, B, T, seed, integer):
    """Logits of every axis, (B, T, n); `integer`: small integers, so that options tie often."""
    g = torch.Generator().manual_seed(seed)
    draw = (lambda n: torch.randint(-2, 3, (B, T, n), generator=g).float()) if integer else \
        (lambda n: torch.randn(B, T, n, generator=g) * 3)
    return {a: draw(n) for a, n in ctrl.sizes.items()}


def _decide(ctrl, cfg, raw, shifts, fused: bool, monkeypatch):
    """The controller's (or, with shifts, the priced) decisions of `raw`: the fused call, or the
    tensor ops (decode_decisions switched off)."""
    with monkeypatch.context() as mp:
        if not fused:
            mp.setattr(controller_mod, "decode_decisions", lambda *a, **k: None)
            mp.setattr(pricing, "decode_decisions", lambda *a, **k: None)
        mp.setattr(ctrl, "logits", lambda hidden, side: {a: z.clone() for a, z in raw.items()})
        B, T = raw["experts"].shape[:2]
        hidden, side = torch.zeros(B, T, cfg.model.d_model), torch.zeros(B, T, 1)
        with torch.no_grad(), StepCounter() as counter:
            if shifts is None:
                out = ctrl(hidden, side)
            else:
                out = pricing.price_decisions(ctrl(hidden, side, decide=False), shifts, None, cfg.model, cfg.router)
            features = decision_features(out, B, T, len(cfg.router.bits), cfg.router.top_k)
    return out, features, counter.foreign_ops.get("triroute.decode_decisions", 0)


@pytest.mark.parametrize("granularity", ["per_head", "token"])
@pytest.mark.parametrize("top_k,null_expert", [(2, True), (1, True), (2, False)])
@pytest.mark.parametrize("priced", [False, True])
@pytest.mark.parametrize("integer", [False, True], ids=["continuous", "ties"])
def test_fused_decisions_equal_the_tensor_ops(granularity, top_k, null_expert, priced, integer, monkeypatch):
    cfg = tiny_config(attn_granularity=granularity, top_k=top_k, null_expert=null_expert)
    ctrl = TriRouteController(cfg, 0).eval()
    for B, T in ((1, 1), (5, 1), (2, 3), (DECODE_LINEAR_ROWS, 1)):
        raw = _logits(cfg, ctrl, B, T, seed=B * 10 + T, integer=integer)
        shifts = None
        if priced:  # per-request prices (the bits' shift is per request: (B, 1, |bits|))
            g = torch.Generator().manual_seed(B + T)
            prices = torch.randn(B, 2, generator=g, dtype=torch.float64) * 2
            positions = torch.randint(0, 40, (B, T), generator=g)
            shifts = price_shifts(prices, positions, cfg.model, cfg.router, ctrl.attn_heads)
        got, got_features, calls = _decide(ctrl, cfg, raw, shifts, True, monkeypatch)
        want, want_features, ref_calls = _decide(ctrl, cfg, raw, shifts, False, monkeypatch)
        assert (calls, ref_calls) == (1, 0)
        assert got.decision_block is not None and want.decision_block is None
        for name in ("y", "y_cost", "hard"):
            assert torch.equal(getattr(got.attn, name), getattr(want.attn, name)), name
            assert torch.equal(getattr(got.bits, name), getattr(want.bits, name)), name
        assert got.attn.hard.shape == (B, T, cfg.model.n_heads)
        for name in ("index", "option"):
            assert torch.equal(getattr(got.experts, name), getattr(want.experts, name)), name
        for name in ("probs", "weight"):  # softmax's exp and the order of its sum
            torch.testing.assert_close(getattr(got.experts, name), getattr(want.experts, name), rtol=1e-6, atol=1e-7)
        assert torch.equal(got_features, want_features)
        assert got.expert_logits.shape == want.expert_logits.shape


def test_ties_go_to_the_lower_option_and_the_null_expert_runs_nothing(monkeypatch):
    cfg = tiny_config(top_k=2, null_expert=True)
    ctrl = TriRouteController(cfg, 0).eval()
    raw = {a: torch.zeros(1, 1, n) for a, n in ctrl.sizes.items()}  # every option ties
    out, features, calls = _decide(ctrl, cfg, raw, None, True, monkeypatch)
    assert calls == 1
    assert out.attn.hard.eq(0).all() and out.bits.hard.eq(0).all()
    assert out.experts.option.tolist() == [[[0, 1]]] and out.experts.index.tolist() == [[[-1, 0]]]
    torch.testing.assert_close(out.experts.weight, torch.full((1, 1, 2), 0.5))
    assert features[0, 0, N_MODES] == 0.5  # one real expert of two


def test_a_replaced_decision_is_read_again_not_taken_from_the_block(monkeypatch):
    """The block is psi's for the decisions it was computed with; an output whose decision was
    replaced afterwards (a forced schedule, a follower's leader) is read from its tensors."""
    cfg = tiny_config()
    ctrl = TriRouteController(cfg, 0).eval()
    raw = _logits(cfg, ctrl, 3, 1, seed=1, integer=False)
    out, _, _ = _decide(ctrl, cfg, raw, None, True, monkeypatch)
    hard = (out.bits.hard + 1) % len(cfg.router.bits)
    y = one_hot(hard, len(cfg.router.bits))
    replaced = dataclasses.replace(out, bits=AxisDecision(y, y, hard))
    got = decision_features(replaced, 3, 1, len(cfg.router.bits), cfg.router.top_k)
    fresh = decision_features(dataclasses.replace(replaced, decision_block=None), 3, 1, len(cfg.router.bits),
                              cfg.router.top_k)
    assert torch.equal(got, fresh) and not torch.equal(got, out.decision_block.features)


def test_more_rows_a_backward_or_training_take_the_tensor_ops():
    cfg = tiny_config()
    ctrl = TriRouteController(cfg, 0).eval()
    hidden, side = make_inputs(cfg, batch=DECODE_LINEAR_ROWS + 1)
    for run in (lambda: ctrl(hidden[:, :1], side[:, :1]),  # more rows than a decode step's
                lambda: ctrl(hidden[:1, :1], side[:1, :1])):  # grad enabled
        with StepCounter() as counter:
            out = run()
        assert "triroute.decode_decisions" not in counter.foreign_ops and out.decision_block is None


def test_the_op_refuses_logits_that_do_not_fit():
    z = torch.zeros(2, 1, 4, 3)
    with pytest.raises(RuntimeError, match="decode_decisions: attn_z .* do not fit"):
        torch.ops.triroute.decode_decisions(z, torch.zeros(3, 1, 5), torch.zeros(2, 1, 4), None, None, None, 2, True)
    with pytest.raises(RuntimeError, match="expert_shift must be a float64"):
        torch.ops.triroute.decode_decisions(z, torch.zeros(2, 1, 5), torch.zeros(2, 1, 4), None,
                                            torch.zeros(2, 1, 5), None, 2, True)
    with pytest.raises(RuntimeError, match="attn_z must be float32"):
        torch.ops.triroute.decode_decisions(z.double(), torch.zeros(2, 1, 5), torch.zeros(2, 1, 4), None, None, None,
                                            2, True)
    g = torch.Generator().manual_seed(0)
    z, e, b = torch.randn(2, 1, 4, 3, generator=g), torch.randn(2, 1, 5, generator=g), torch.randn(2, 1, 4, generator=g)
    shifts = (torch.rand(2, 1, 1, 3, generator=g, dtype=torch.float64), torch.rand(2, 1, 5, generator=g, dtype=torch.float64),
              torch.rand(2, 1, 4, generator=g, dtype=torch.float64))
    for args in ((z, e, b, None, None, None, 2, True), (z, e, b, *shifts, 1, False)):
        torch.library.opcheck(torch.ops.triroute.decode_decisions, args)
