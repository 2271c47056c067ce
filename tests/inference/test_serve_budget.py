"""A budget per request (inference/serve_budget.py and the engine): the price curve inverted by
hand, an infeasible target refused naming the reachable range, the control's arithmetic, the
per-request audit against the engine's whole audit, and a batch mixing budgets equal to each
request served alone (tokens, realised fractions, the widths its KV pages hold)."""

import pytest
import torch

from megatron_triroute.inference.engine import InferenceEngine
from megatron_triroute.inference.serve_budget import (BIAS_WEIGHT, PAYBACK_GAIN, InfeasibleTargetError,
                                                      PriceCurve, RequestBudget)
from megatron_triroute.input_errors import InputError
from tests.inference.test_engine import PROMPTS, tiny_model

CURVE = PriceCurve([-4.0, -1.0, 0.0, 2.0, 8.0], [0.9, 0.8, 0.6, 0.6, 0.3], [1.0, 0.7, 0.5, 0.4, 0.2])


def test_the_curve_is_inverted_by_linear_interpolation_and_made_non_increasing():
    assert CURVE.price_for(0, 0.7) == pytest.approx(-0.5)  # halfway from (-1, 0.8) to (0, 0.6)
    assert CURVE.price_for(1, 0.3) == pytest.approx(5.0)  # halfway from (2, 0.4) to (8, 0.2)
    assert CURVE.price_for(0, 0.6) == 0.0  # a flat stretch: its lowest price
    assert CURVE.price_for(0, 0.95) == -4.0 and CURVE.price_for(1, 0.2) == 8.0  # the ends
    assert CURVE.reachable(0) == (0.3, 0.9) and CURVE.reachable(1) == (0.2, 1.0)
    bumpy = PriceCurve([0.0, 1.0, 2.0], [0.5, 0.55, 0.4], [0.5, 0.5, 0.5])  # noise on the calibration data
    assert bumpy.flops == [0.5, 0.5, 0.4]
    assert PriceCurve.from_dict(CURVE.to_dict()) == CURVE
    with pytest.raises(ValueError, match="strictly ascending"):
        PriceCurve([0.0, 0.0], [1.0, 1.0], [1.0, 1.0])


def test_an_infeasible_target_names_the_reachable_range():
    with pytest.raises(InfeasibleTargetError, match=r"FLOPs target 0.2 is infeasible.*from 0.3000 .* to 0.9000.*"
                                                    r"at least 0.3000") as error:
        CURVE.check(0, 0.2)
    assert isinstance(error.value, ValueError) and isinstance(error.value, InputError)
    with pytest.raises(InfeasibleTargetError, match="KV-memory target 0"):
        CURVE.check(1, 0.0)
    CURVE.check(0, 1.0)  # above the dearest policy: a budget it keeps, served at the lowest price
    with pytest.raises(ValueError, match="KV-memory target 0.1 is infeasible"):
        InferenceEngine(tiny_model(), price_curve=CURVE).add([1, 2], 4, target_mem=0.1)
    with pytest.raises(ValueError, match="price curve"):
        InferenceEngine(tiny_model()).add([1, 2], 4, target_flops=0.5)


def test_the_control_removes_the_requests_bias_and_pays_back_its_error():
    budget = RequestBudget(CURVE, (0.7, None), (0.25, -0.5))
    assert budget.prices == [pytest.approx(-0.5), -0.5]  # the curve's price; memory keeps the model's own
    budget.update([74.0, 100.0, 90.0, 100.0])  # the first step aimed at 0.7 and realised 0.74
    aim = 0.7 - 0.04 + PAYBACK_GAIN * (0.7 - 0.74)
    assert budget.aims[0] == pytest.approx(aim)
    assert budget.prices[0] == pytest.approx(CURVE.price_for(0, aim)) and budget.prices[1] == -0.5
    budget.update([74.0 + 60.0, 200.0, 180.0, 200.0])  # the second aimed at `aim` and realised 0.6
    bias = (1 - BIAS_WEIGHT) * 0.04 + BIAS_WEIGHT * (0.6 - aim)
    assert budget.aims[0] == pytest.approx(0.7 - bias + PAYBACK_GAIN * (0.7 - 134.0 / 200.0))
    budget.update([134.0 + 1.0, 300.0, 270.0, 300.0])  # far under: the aim is clipped to the curve's top
    assert budget.aims[0] == 0.9 and budget.prices[0] == -4.0
    fixed = RequestBudget(CURVE, (0.7, None), (0.25, -0.5), control=False)
    fixed.update([74.0, 100.0, 90.0, 100.0])
    assert fixed.prices[0] == pytest.approx(-0.5)


def _serve(model, prompts, targets, steps):
    engine = InferenceEngine(model, page_size=4, price_curve=CURVE)
    rids = [engine.add(p, 50, None, *t) for p, t in zip(prompts, targets)]
    for _ in range(steps):
        engine.step()
    engine.cache.sync(rids)
    widths = [[[e.count for e in entries] for entries in engine.cache.requests[r]] for r in rids]
    return engine, rids, widths


def test_a_batch_mixing_budgets_equals_each_request_served_alone():
    model = tiny_model()
    model.prices.copy_(torch.tensor([0.2, -0.3], dtype=torch.float64))  # the model's own, calibrated prices
    # The last request keeps the model's own budget: alone it is priced by the (2,) path, in the
    # batch by its row of the model's prices.
    targets = [(0.35, 0.3), (None, 0.9), (0.8, None), (None, None)]
    engine, rids, widths = _serve(model, PROMPTS + [PROMPTS[0]], targets, 12)
    alone = [_serve(model, [p], [t], 12) for p, t in zip(PROMPTS + [PROMPTS[0]], targets)]
    for i, (e, (r,), (w,)) in enumerate(alone):
        assert engine.requests[rids[i]].generated == e.requests[r].generated, i
        assert engine.realised(rids[i]) == e.realised(r), i
        assert widths[i] == w, i  # per layer, the slots each KV width's pool holds for the request
    realised = [engine.realised(r) for r in rids]
    assert realised[0][1] < realised[1][1]  # the budgets differ, and so do the widths chosen
    assert len({tuple(map(tuple, w)) for w in widths}) == 4
    # The per-request costs add up to the engine's own audit.
    audit = engine.audit
    totals = [sum(audit.requests[r][i] for r in rids) for i in range(4)]
    assert totals[0] == pytest.approx(audit.budgeted_macs, rel=1e-12)
    assert totals[1] == pytest.approx(audit.dense_macs, rel=1e-12)
    # ... and the dense MACs are Appendix A's of every position each request consumed, counted by hand
    m = model.config.model
    consumed = [engine.requests[r].state.length for r in rids]
    assert min(consumed) > len(PROMPTS[0])  # prompts and generated tokens
    by_hand = sum((2 * m.d_model * (t + 1) + 3 * m.d_model * m.d_ff) * m.n_layers for n in consumed for t in range(n))
    assert audit.dense_macs == by_hand
    assert totals[2] == pytest.approx(8 * audit.total("bytes_written"), rel=1e-12)
    assert totals[3] == pytest.approx(8 * audit.dense_kv_bytes, rel=1e-12)
