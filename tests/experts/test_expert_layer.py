"""Single-process tests of the DeepSpeed-backed expert layer: null-expert semantics, the gate contract,
no-drop and capacity-drop behaviour, checked against explicit expert math."""

import pytest
import torch
import torch.nn.functional as F

from megatron_triroute.experts import NULL_EXPERT, PrecomputedGate, TriRouteExperts, stacked, swiglu
from megatron_triroute.parallel.groups import ParallelGroups

D_MODEL, D_EXPERT, NUM_EXPERTS = 8, 12, 4


def expert_math(weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """w2 (silu(w1 x) * w3 x), written out with one expert's weight matrices (w1, w3, w2)."""
    w1, w3, w2 = weights
    gate = x @ w1.t()
    value = x @ w3.t()
    return (gate * torch.sigmoid(gate) * value) @ w2.t()


def hand_output(layer: TriRouteExperts, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                kept: torch.Tensor | None = None) -> torch.Tensor:
    """sum over a token's kept, non-null routes of weight * expert(x); zero when there are none."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[n, j])
            if e != NULL_EXPERT and (kept is None or kept[n, j]):
                out[n] += weight[n, j] * expert_math(layer.experts.expert(e), x[n])
    return out


def make_layer(top_k: int, capacity_factor=None, seed: int = 0, compute: str = "deepspeed") -> TriRouteExperts:
    """The adapter's tests read DeepSpeed's dispatch (exp_counts, the gate's routes): its path by
    default; `compute="grouped"` is the one-rank default (tests/experts/test_grouped.py)."""
    torch.manual_seed(seed)
    return TriRouteExperts(D_MODEL, D_EXPERT, NUM_EXPERTS, capacity_factor=capacity_factor, top_k=top_k,
                           compute=compute)


def test_swiglu_matches_formula():
    torch.manual_seed(1)
    weights = (torch.randn(D_EXPERT, D_MODEL), torch.randn(D_EXPERT, D_MODEL), torch.randn(D_MODEL, D_EXPERT))
    x = torch.randn(5, D_MODEL)
    w1, w3, w2 = (torch.nn.Linear(1, 1, bias=False) for _ in range(3))
    for lin, w in zip((w1, w3, w2), weights):
        lin.weight = torch.nn.Parameter(w)
    torch.testing.assert_close(swiglu(x, *weights), w2(F.silu(w1(x)) * w3(x)), rtol=0, atol=0)  # nn.Linear's
    torch.testing.assert_close(swiglu(x, *weights), expert_math(weights, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compute", ["deepspeed", "grouped"])
def test_null_expert_top1_gives_exact_zero(compute):
    layer = make_layer(top_k=1, compute=compute)
    x = torch.randn(6, D_MODEL, requires_grad=True)
    index = torch.tensor([[0], [NULL_EXPERT], [3], [NULL_EXPERT], [1], [2]])
    weight = torch.rand(6, 1, requires_grad=True)

    out = layer(x, index, weight)

    null_rows = (index[:, 0] == NULL_EXPERT)
    assert torch.equal(out[null_rows], torch.zeros(2, D_MODEL))  # exactly zero, not merely small
    torch.testing.assert_close(out, hand_output(layer, x, index, weight), rtol=1e-6, atol=1e-6)
    if compute == "deepspeed":
        assert layer.moe.exp_counts.tolist() == [1, 1, 1, 1]  # null routes are never dispatched

    out.square().sum().backward()
    assert torch.equal(x.grad[null_rows], torch.zeros(2, D_MODEL))
    assert torch.equal(weight.grad[null_rows], torch.zeros(2, 1))  # its weight contributes nothing


def test_null_expert_top2_runs_exactly_one_expert():
    layer = make_layer(top_k=2)
    x = torch.randn(5, D_MODEL, requires_grad=True)
    # token 0: {null, 2}; token 1: {1, null}; token 2: {0, 3}; token 3: {null, null}; token 4: {2, 1}
    index = torch.tensor([[NULL_EXPERT, 2], [1, NULL_EXPERT], [0, 3], [NULL_EXPERT, NULL_EXPERT], [2, 1]])
    weight = torch.rand(5, 2, requires_grad=True)
    captured = {}
    gate_forward = layer.gate.forward

    def spy(*args):
        captured["routes"] = gate_forward(*args)
        return captured["routes"]

    layer.gate.forward = spy
    out = layer(x, index, weight)

    indices = captured["routes"][3]  # (k, N): what MOELayer dispatches
    assert (indices[:, 0] >= 0).sum() == 1 and indices[1, 0] == 2  # {null, j} dispatches only j
    assert (indices[:, 3] >= 0).sum() == 0
    assert layer.moe.exp_counts.sum() == 6  # six real routes out of ten
    torch.testing.assert_close(out[0], weight[0, 1] * expert_math(layer.experts.expert(2), x[0]), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[3], torch.zeros(D_MODEL))
    torch.testing.assert_close(out, hand_output(layer, x, index, weight), rtol=1e-6, atol=1e-6)

    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    assert weight.grad[0, 0] == 0 and weight.grad[3].abs().sum() == 0
    # d out_0 / d weight_0j = f_j(x_0), so the gate gradient is <upstream_0, f_j(x_0)>
    expected = (upstream[0] * expert_math(layer.experts.expert(2), x[0])).sum()
    torch.testing.assert_close(weight.grad[0, 1], expected.detach(), rtol=1e-5, atol=1e-6)


def test_gate_speaks_deepspeed_sparse_route_contract():
    """Same arity, dtypes and shapes as DeepSpeed 0.19.8's own top2gating(..., sparse_routes=True)."""
    from deepspeed.moe.sharded_moe import top2gating

    n = 7
    reference = top2gating(torch.randn(n, NUM_EXPERTS), 1.0, 1, drop_tokens=False, sparse_routes=True)
    gate = PrecomputedGate(NUM_EXPERTS, k=2)
    gate.set_routes(torch.randint(-1, NUM_EXPERTS, (n, 2)), torch.rand(n, 2))
    ours = gate(torch.randn(n, D_MODEL), None, True, False)

    assert len(ours) == len(reference) == 7
    assert ours[2] == reference[2] == NUM_EXPERTS
    for position in (0, 1, 3, 4, 5, 6):
        assert ours[position].shape == reference[position].shape, position
        assert ours[position].dtype == reference[position].dtype, position
    assert int(ours[1]) >= 1 and gate.k == 2 and hasattr(gate, "_set_ep_group")
    with pytest.raises(RuntimeError, match="set_routes"):
        gate(torch.randn(n, D_MODEL), None, True, False)  # routes are consumed by one forward


def test_routes_are_validated():
    gate = PrecomputedGate(NUM_EXPERTS, k=2)
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        gate.set_routes(torch.tensor([[0, 4]]), torch.rand(1, 2))
    with pytest.raises(ValueError, match="k=1 columns"):
        gate.set_routes(torch.tensor([[0]]), torch.rand(1, 1))
    gate.set_routes(torch.tensor([[0, 1]]), torch.rand(1, 2))
    with pytest.raises(ValueError, match="cover 1 tokens"):
        gate(torch.randn(3, D_MODEL), None, True, False)


@pytest.mark.parametrize("compute", ["deepspeed", "grouped"])
def test_no_drop_with_all_tokens_on_one_expert(compute):
    layer = make_layer(top_k=2, compute=compute)
    n = 9
    x = torch.randn(n, D_MODEL)
    index = torch.stack([torch.full((n,), 3), torch.full((n,), NULL_EXPERT)], dim=1)
    index[::2, 1] = 3  # some tokens even route to expert 3 twice
    weight = torch.rand(n, 2)

    out = layer(x, index, weight)

    if compute == "deepspeed":
        assert layer.moe.exp_counts.tolist() == [0, 0, 0, n + (n + 1) // 2]
    torch.testing.assert_close(out, hand_output(layer, x, index, weight), rtol=1e-6, atol=1e-6)
    assert (out.abs().sum(dim=1) > 0).all()  # every token got its expert output: nothing dropped


@pytest.mark.parametrize("compute", ["deepspeed", "grouped"])
def test_no_drop_output_does_not_depend_on_other_tokens(compute):
    layer = make_layer(top_k=2, compute=compute)
    x = torch.randn(6, D_MODEL)
    index = torch.tensor([[0, 1], [0, NULL_EXPERT], [0, 2], [0, 3], [1, 0], [NULL_EXPERT, 0]])
    weight = torch.rand(6, 2)
    full = layer(x, index, weight)
    alone = layer(x[:1], index[:1], weight[:1])
    torch.testing.assert_close(full[:1], alone, rtol=1e-6, atol=1e-6)


def test_capacity_factor_drops_slot_major_then_token_order():
    # capacity = ceil(0.5 * N * k / E) = ceil(0.5 * 4 * 2 / 2) = 2 slots per expert
    torch.manual_seed(3)
    layer = TriRouteExperts(D_MODEL, D_EXPERT, 2, capacity_factor=0.5, top_k=2)
    x = torch.randn(4, D_MODEL)
    index = torch.tensor([[0, 1], [1, 0], [0, 1], [0, 1]])
    weight = torch.rand(4, 2)
    # Column 0 is placed first, in token order: expert 0 takes tokens 0 and 2, then is full, so
    # token 3's first route and token 1's second route are dropped. Expert 1 takes token 1 (col 0)
    # then token 0 (col 1); tokens 2 and 3's second routes are dropped.
    kept = torch.tensor([[True, True], [True, False], [True, False], [False, False]])

    out = layer(x, index, weight)

    torch.testing.assert_close(out, hand_output(layer, x, index, weight, kept), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[3], torch.zeros(D_MODEL))  # both routes dropped: zero, like the null expert


def test_capacity_factor_with_skewed_routes_keeps_earliest_tokens():
    torch.manual_seed(4)
    layer = TriRouteExperts(D_MODEL, D_EXPERT, NUM_EXPERTS, capacity_factor=1.0, top_k=1)
    n = 8  # capacity = ceil(1.0 * 8 * 1 / 4) = 2
    x = torch.randn(n, D_MODEL)
    index = torch.zeros(n, 1, dtype=torch.long)
    weight = torch.ones(n, 1)
    out = layer(x, index, weight)
    kept = torch.zeros(n, 1, dtype=torch.bool)
    kept[:2] = True
    torch.testing.assert_close(out, hand_output(layer, x, index, weight, kept), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[2:], torch.zeros(n - 2, D_MODEL))


def test_expert_params_carry_deepspeed_moe_attributes():
    layer = make_layer(top_k=2)
    expert_params = list(layer.moe.experts.parameters())
    assert [tuple(p.shape) for p in expert_params] == [(NUM_EXPERTS, D_EXPERT, D_MODEL)] * 2 + [(NUM_EXPERTS, D_MODEL, D_EXPERT)]
    assert all(p.allreduce is False and p.group_name == "ep_size_1" for p in expert_params)
    from deepspeed.moe.utils import is_moe_param

    assert all(is_moe_param(p) for p in expert_params)
    # each expert is initialised on its own
    assert not torch.equal(layer.experts.expert(0)[0], layer.experts.expert(1)[0])


def test_sequence_parallel_with_tensor_parallel_is_refused():
    groups = ParallelGroups(
        world_size=2, rank=0, tp=2, pp=1, dp=1, ep=1, edp=2, tp_rank=0, pp_rank=0, dp_rank=0, ep_rank=0,
        edp_rank=0, tp_group=None, pp_group=None, dp_group=None, ep_group=None, edp_group=None,
        tp_ranks=(0, 1), dp_ranks=(0,), ep_ranks=(0,), edp_ranks=(0, 1), ep_group_name="ep_size_1",
    )
    with pytest.raises(ValueError, match="gather the sequence"):
        TriRouteExperts(D_MODEL, D_EXPERT, NUM_EXPERTS, groups, sequence_parallel=True)


@pytest.mark.parametrize("capacity_factor", [None, 1.5])
def test_each_expert_runs_on_its_filled_slots_only_with_deepspeeds_values_and_gradients(capacity_factor):
    """Skewed routes (expert 3 takes most): the packed compute gives the hand output, and the same
    gradients (input, route weights, every expert weight) as DeepSpeed's whole-buffer compute of the
    same layer; each expert's input has exactly its kept routes' rows."""
    n = 10
    layer = make_layer(top_k=2, capacity_factor=capacity_factor, seed=5)
    index = torch.tensor([[3, 1]] * 6 + [[3, NULL_EXPERT], [0, 3], [NULL_EXPERT, NULL_EXPERT], [3, 0]])
    torch.manual_seed(6)
    x, weight = torch.randn(n, D_MODEL), torch.rand(n, 2)

    def run(packed: bool):
        rows = []
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        layer.zero_grad()
        with pytest.MonkeyPatch.context() as mp:  # each expert call's rows
            mp.setattr(stacked, "swiglu", lambda h, *w: rows.append(h.shape[-2]) or swiglu(h, *w))
            if not packed:  # no filled counts from the gate: every expert over its whole buffer, as DeepSpeed's Experts
                mp.delitem(layer.moe.experts.__dict__, "_gate")
            out = layer(xs, index, ws)
        (out * torch.linspace(-1, 1, D_MODEL)).sum().backward()
        grads = [xs.grad, ws.grad, *(p.grad.clone() for p in layer.moe.experts.parameters())]
        return out.detach(), grads, rows

    out, grads, rows = run(packed=True)
    full_out, full_grads, full_rows = run(packed=False)
    capacity = 9 if capacity_factor is None else 8  # no drops: expert 3's 9 routes; else ceil(1.5 * 10 * 2 / 4)
    assert full_rows == [capacity] * NUM_EXPERTS
    assert rows == [min(c, capacity) for c in (2, 6, 0, 9)]  # routes per expert, at most the capacity
    kept = None
    if capacity_factor is not None:  # expert 3's ninth route (token 7's column 1, placed last) is dropped
        kept = torch.ones(n, 2, dtype=torch.bool)
        kept[7, 1] = False
    torch.testing.assert_close(out, hand_output(layer, x, index, weight, kept), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, full_out, rtol=1e-6, atol=1e-7)
    for got, want in zip(grads, full_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_per_expert_names_of_earlier_checkpoints_load_into_the_stacked_weights():
    """A state dict in DeepSpeed's one-module-per-expert names (`deepspeed_experts.<i>.w1.weight`)
    loads into the stacked parameters, expert i at row i; the helper leaves other names alone and
    refuses a run of experts with a gap."""
    layer = make_layer(top_k=2, seed=4)
    other = make_layer(top_k=2, seed=5)
    legacy = {f"moe.experts.deepspeed_experts.{i}.{w}.weight": getattr(other.experts, w).weight[i].clone()
              for i in range(NUM_EXPERTS) for w in ("w1", "w3", "w2")}
    assert not torch.equal(layer.experts.w2.weight, other.experts.w2.weight)
    layer.load_state_dict(legacy)
    for w in ("w1", "w3", "w2"):
        assert torch.equal(getattr(layer.experts, w).weight, getattr(other.experts, w).weight), w
    from megatron_triroute.checkpoint.sharded import stack_per_expert_names

    converted = stack_per_expert_names({"a.b": torch.zeros(1), **legacy})
    assert sorted(converted) == ["a.b", "moe.experts.w1.weight", "moe.experts.w2.weight", "moe.experts.w3.weight"]
    del legacy["moe.experts.deepspeed_experts.2.w1.weight"]
    with pytest.raises(ValueError, match="not 0..2.*load the complete checkpoint"):
        stack_per_expert_names(legacy)
