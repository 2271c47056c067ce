"""experts/grouped.py: every expert in grouped matmuls after one sort, against the per-expert
twin (`triroute_kernels.paged_ops.routed_experts_torch`) and DeepSpeed's dispatch of the same layer:
values, gradients, the null expert, no host read."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.op_counter import StepCounter
from megatron_triroute.experts import NULL_EXPERT, TriRouteExperts
from megatron_triroute.experts.grouped import grouped_swiglu
from triroute_kernels.paged_ops import routed_experts_torch

D, F_, E = 8, 16, 4


def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    w1, w3, w2 = (torch.randn(E, F_, D, generator=g) / 3, torch.randn(E, F_, D, generator=g) / 3,
                  torch.randn(E, D, F_, generator=g) / 3)
    return w1, w3, w2


@pytest.mark.parametrize("k", [1, 2, 3])
def test_values_and_gradients_equal_the_per_expert_twin(k):
    """Random routes with the null expert, an expert nobody picks, a token with only null routes:
    output and the gradients to the tokens, the route weights and every expert weight."""
    g = torch.Generator().manual_seed(k)
    N = 11
    index = torch.randint(-1, E - 1, (N, k), generator=g)  # expert E - 1 gets nothing
    index[4] = NULL_EXPERT
    x, weight = torch.randn(N, D, generator=g), torch.rand(N, k, generator=g)
    w1, w3, w2 = _weights(k)
    upstream = torch.randn(N, D, generator=g)

    def run(grouped: bool):
        leaves = [t.clone().requires_grad_() for t in (x, weight, w1, w3, w2)]
        xs, ws, a, b, c = leaves
        if grouped:
            out = grouped_swiglu(xs, index, ws, a, b, c)
        else:
            out = routed_experts_torch(xs, index, ws, list(a), list(b), list(c))
        (out * upstream).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    out, grads = run(grouped=True)
    want, want_grads = run(grouped=False)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[4], torch.zeros(D))
    for got, ref in zip(grads, want_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(grads[2][E - 1], torch.zeros(F_, D))  # the unused expert gets no gradient


def test_every_route_null_gives_exact_zeros():
    x = torch.randn(5, D, requires_grad=True)
    weight = torch.rand(5, 2, requires_grad=True)
    w1, w3, w2 = (t.requires_grad_() for t in _weights(0))
    out = grouped_swiglu(x, torch.full((5, 2), NULL_EXPERT), weight, w1, w3, w2)
    assert torch.equal(out, torch.zeros(5, D))
    out.square().sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(weight.grad, torch.zeros_like(weight))


class _Uncomputed(torch.autograd.Function):
    """`F.grouped_mm` whose rows past the last group (which it never computes) hold NaN, in its
    output and in its input's gradient: what uninitialised memory may hold on any device."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        out = _GROUPED_MM(a, b, offs=offs).clone()
        out[int(offs[-1]):] = float("nan")
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, offs = ctx.saved_tensors
        with torch.enable_grad():
            a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
            ga, gb = torch.autograd.grad(_GROUPED_MM(a_, b_, offs=offs), (a_, b_), grad.nan_to_num(0.0))
        ga = ga.clone()
        ga[int(offs[-1]):] = float("nan")
        return ga, gb, None


_GROUPED_MM = torch.nn.functional.grouped_mm


def test_rows_no_grouped_matmul_computes_never_reach_a_value_or_a_gradient(monkeypatch):
    """The null routes' rows are never computed by the grouped matmuls: with NaN there (forward and
    backward), the output and every gradient still equal the per-expert twin's."""
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda a, b, offs: _Uncomputed.apply(a, b, offs))
    g = torch.Generator().manual_seed(5)
    N, k = 9, 2
    index = torch.randint(-1, E, (N, k), generator=g)
    index[2] = NULL_EXPERT
    assert (index < 0).any()
    x, weight, upstream = torch.randn(N, D, generator=g), torch.rand(N, k, generator=g), torch.randn(N, D, generator=g)
    w1, w3, w2 = _weights(5)
    results = []
    for grouped in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, weight, w1, w3, w2)]
        xs, ws, a, b, c = leaves
        out = grouped_swiglu(xs, index, ws, a, b, c) if grouped else \
            routed_experts_torch(xs, index, ws, list(a), list(b), list(c))
        (out * upstream).sum().backward()
        results.append((out.detach(), [t.grad for t in leaves]))
    (out, grads), (want, want_grads) = results
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, ref in zip(grads, want_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def _layer(compute: str, seed: int = 3) -> TriRouteExperts:
    torch.manual_seed(seed)
    return TriRouteExperts(D, F_, E, top_k=2, compute=compute)


def test_the_layer_equals_deepspeeds_dispatch_of_the_same_weights():
    """The same layer (same seed) through DeepSpeed's MOELayer and through the grouped matmuls:
    outputs and every gradient agree."""
    g = torch.Generator().manual_seed(9)
    N = 13
    index = torch.randint(-1, E, (N, 2), generator=g)
    index[:6, 0] = 3  # one expert takes most routes
    x, weight, upstream = torch.randn(N, D, generator=g), torch.rand(N, 2, generator=g), torch.randn(N, D, generator=g)
    results = {}
    for compute in ("deepspeed", "grouped"):
        layer = _layer(compute)
        assert layer.grouped == (compute == "grouped")
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = layer(xs, index, ws)
        (out * upstream).sum().backward()
        results[compute] = (out.detach(), [xs.grad, ws.grad, *(p.grad for p in layer.moe.experts.parameters())])
    (a, ga), (b, gb) = results["deepspeed"], results["grouped"]
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for got, want in zip(gb, ga):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_grouped_layer_reads_nothing_back_and_deepspeeds_does():
    """One forward and backward under the dispatch counter: no host read on the grouped path;
    DeepSpeed's dispatch reads the capacity (and validates the routes) on the host."""
    index = torch.tensor([[0, 1], [NULL_EXPERT, 2], [3, 3], [1, NULL_EXPERT]])
    syncs = {}
    for compute in ("grouped", "deepspeed"):
        layer = _layer(compute)
        x = torch.randn(4, D, requires_grad=True)
        counter = StepCounter()
        with counter:
            layer(x, index, torch.rand(4, 2, requires_grad=True)).sum().backward()
        syncs[compute] = sum(counter.syncs.values())
    assert syncs["grouped"] == 0 and syncs["deepspeed"] >= 1


def test_the_grouped_backward_adds_without_atomics():
    """The gathers' backward is a gather and a sum over each token's routes: no index_add_ (atomic
    adds on a GPU) runs in the forward or the backward."""
    index = torch.tensor([[0, 1], [NULL_EXPERT, 2], [3, 3], [1, NULL_EXPERT]])
    layer = _layer("grouped")
    seen = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Ops():
        layer(torch.randn(4, D, requires_grad=True), index, torch.rand(4, 2, requires_grad=True)).sum().backward()
    assert "aten.index_select" in seen and not {"aten.index_add", "aten.index_add_", "aten.index_put_"} & seen


def test_the_experts_forward_pre_hooks_run_on_the_grouped_path():
    """Megatron's DDP waits for an in-flight parameter all-gather in each module's forward pre-hook;
    the grouped path reads the stacked weights by calling the modules that hold them, so it runs them."""
    layer = _layer("grouped")
    fired = []
    for proj in (layer.experts.w1, layer.experts.w3, layer.experts.w2):
        proj.register_forward_pre_hook(lambda module, args: fired.append(module))
    layer.experts.w1.register_forward_pre_hook(lambda module, args, kwargs: fired.append("kw"), with_kwargs=True)
    layer(torch.randn(3, D), torch.tensor([[0, 1], [2, NULL_EXPERT], [3, 0]]), torch.rand(3, 2))
    assert fired.count("kw") == 1
    modules = [m for m in fired if m != "kw"]
    assert len(modules) == 3 and len({id(m) for m in modules}) == 3


def test_under_bf16_autocast_it_computes_in_bf16():
    layer = _layer("grouped")
    x = torch.randn(6, D)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [NULL_EXPERT, 1], [2, NULL_EXPERT]])
    weight = torch.rand(6, 2)
    want = layer(x, index, weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x, index, weight)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_a_layer_that_shards_or_drops_or_has_unaligned_rows_takes_deepspeeds_dispatch():
    torch.manual_seed(0)
    assert not TriRouteExperts(D, F_, E, top_k=2, capacity_factor=1.0).grouped
    # 12 bf16 values are 24 bytes, not a multiple of 16: the grouped matmul refuses such rows, so
    # under bf16 autocast the layer dispatches through DeepSpeed, with the same values
    layer = TriRouteExperts(D, 12, E, top_k=2)
    index, x, weight = torch.tensor([[0, 1], [2, NULL_EXPERT]]), torch.randn(2, D), torch.rand(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, index, weight)
    assert layer.moe.exp_counts is not None and layer.moe.exp_counts.tolist() == [1, 1, 1, 0]
    torch.testing.assert_close(out.float(), layer(x, index, weight), rtol=3e-2, atol=3e-2)
    with pytest.raises(ValueError, match="auto, grouped or deepspeed"):
        TriRouteExperts(D, F_, E, top_k=2, compute="fast")


def test_auto_takes_the_grouped_matmuls_on_every_device():
    layer = _layer("auto")
    x = torch.randn(3, D)
    assert layer.grouped and layer.uses_grouped(x)  # a CPU tensor too
    assert _layer("grouped").uses_grouped(x) and not _layer("deepspeed").uses_grouped(x)
    if torch.cuda.is_available():
        assert layer.uses_grouped(x.cuda())


@pytest.mark.gpu
def test_on_cuda_bf16_grouped_matmuls_match_the_twin():
    """On a GPU: in bf16 the grouped matmuls (CUTLASS on Hopper) against the per-expert twin in
    float32; in float32 (PyTorch's looped fallback) to float32 accuracy. Model-sized widths."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    N, k, d, f, e = 4096, 2, 768, 384, 8
    index = torch.randint(-1, e, (N, k), generator=g).to(dev)
    x, weight = torch.randn(N, d, generator=g).to(dev), torch.rand(N, k, generator=g).to(dev)
    w1, w3, w2 = (torch.randn(e, f, d, generator=g) / 30).to(dev), (torch.randn(e, f, d, generator=g) / 30).to(dev), \
        (torch.randn(e, d, f, generator=g) / 30).to(dev)
    want = routed_experts_torch(x, index, weight, list(w1), list(w3), list(w2))
    got = grouped_swiglu(x, index, weight, w1, w3, w2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got16 = grouped_swiglu(x, index, weight, w1, w3, w2)
    assert got16.dtype == torch.bfloat16
    rel = (got16.float() - want).norm() / want.norm()
    assert rel < 2e-2, rel
