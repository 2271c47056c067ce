"""The pipeline-stage wire: hidden states plus the routing state as rows, and back, exactly, with
gradients flowing through."""

import torch

from megatron_triroute.routing.state import RoutingState, has_leader, has_reward
from megatron_triroute.model.stage_wire import WireLayout, receive, send
from megatron_triroute.routing.controller import AxisDecision
from megatron_triroute.routing.modes import N_MODES
from tests.model.harness import tiny_triroute


def _state(layout: WireLayout, B: int, g: torch.Generator) -> RoutingState:
    T, H = layout.seq_len, layout.n_heads
    decisions = torch.rand(B, T, layout.n_decision, generator=g).requires_grad_()
    leader = None
    if layout.leader:
        y = torch.nn.functional.one_hot(torch.randint(0, N_MODES, (B, T, H), generator=g), N_MODES).float()
        leader = AxisDecision(y.clone().requires_grad_(), y.clone().requires_grad_(), y.argmax(-1))
    reward = torch.zeros(B, T, 2).requires_grad_() if layout.reward else None
    return RoutingState(decisions, leader, reward)


def test_round_trip_is_exact_and_differentiable():
    g = torch.Generator().manual_seed(0)
    for cfg in (tiny_triroute(), tiny_triroute(attn_granularity="layer_group", layer_group_size=2),
                tiny_triroute(estimator="reinforce")):
        layout = WireLayout.of(cfg)
        assert (layout.leader, layout.reward) == (has_leader(cfg), has_reward(cfg))
        T, d, B = cfg.model.seq_len, cfg.model.d_model, 3
        per_token = layout.n_decision + (7 * cfg.model.n_heads if layout.leader else 0) + (2 if layout.reward else 0)
        assert layout.rows == -(-T * per_token // d) and layout.seq_length == T + layout.rows
        x = torch.randn(T, B, d, generator=g, requires_grad=True)
        state = _state(layout, B, g)
        wire = send(x, state, layout)
        assert wire.shape == (T + layout.rows, B, d)
        x2, got = receive(wire, layout)
        assert torch.equal(x2, x) and torch.equal(got.decisions, state.decisions)
        assert (got.leader is None) == (state.leader is None) and (got.reward is None) == (state.reward is None)
        if state.leader is not None:
            for a, b in zip((got.leader.y, got.leader.y_cost, got.leader.hard),
                            (state.leader.y, state.leader.y_cost, state.leader.hard)):
                assert torch.equal(a, b) and a.dtype == b.dtype
        if state.reward is not None:
            assert torch.equal(got.reward, state.reward)
        # gradients reach the sender's tensors unchanged
        probe = [torch.randn(t.shape, generator=g) for t in (x2, got.decisions)]
        loss = (x2 * probe[0]).sum() + (got.decisions * probe[1]).sum()
        if got.reward is not None:
            loss = loss + got.reward[..., 0].sum() * 2
        loss.backward()
        assert torch.equal(x.grad, probe[0]) and torch.equal(state.decisions.grad, probe[1])
        if state.reward is not None:
            assert torch.equal(state.reward.grad[..., 0], torch.full((B, T), 2.0))
            assert torch.equal(state.reward.grad[..., 1], torch.zeros(B, T))


def test_flat_tensors_round_trip():
    g = torch.Generator().manual_seed(1)
    cfg = tiny_triroute(attn_granularity="layer_group", layer_group_size=2, estimator="reinforce")
    state = _state(WireLayout.of(cfg), 2, g)
    flat = state.tensors()
    assert len(flat) == 5
    back = RoutingState.from_tensors(flat, leader=True, reward=True)
    assert back.decisions is state.decisions and back.leader.hard is state.leader.hard and back.reward is state.reward
    assert len(RoutingState.from_tensors(flat[:1], leader=False, reward=False).tensors()) == 1
