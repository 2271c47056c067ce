"""One decode step is static: no host read, one call per layer of each kernel op, and at most
`OPS_PER_LAYER` top-level aten ops per layer (issue target; with zero and nonzero prices: the
model's calibrated ones or each request's own), counted by dispatching it under
`benchmarks.op_counter.StepCounter`; a layer's ops after its decisions in one call
(`triroute.decode_layer`), equal bit for bit to them op by op. The scheduler reads the device counts
once per page of decode steps, and a request holds at most two unfilled pages per pool."""

import contextlib

import pytest
import torch

from benchmarks.op_counter import StepCounter, model_weights
from megatron_triroute.inference.side_state import SideState
from megatron_triroute.routing.modes import SKIP
from megatron_triroute.routing.state import RoutingState
from tests.inference.test_engine import tiny_model

OPS_PER_LAYER = 120
"""The target, priced or not (measured 41-44 on this 2-layer model, priced or not: the
priced argmax of the three axes is the same one call as the plain one, `triroute.decode_decisions`,
with the step's price shifts, computed on the host once per step)."""
DECISION_OPS = ("triroute.controller_logits", "triroute.decode_decisions")
LAYER_OPS = ("triroute.paged_attention", "triroute.cache_append", "triroute.routed_experts", "triroute.decode_qkv")
"""What `triroute.decode_layer` runs in one call (op by op: each once per layer)."""


@contextlib.contextmanager
def captured_calls(name: str):
    """The argument tuples of every call of `torch.ops.triroute.<name>` inside the context (the op runs)."""
    real, calls = getattr(torch.ops.triroute, name), []

    def capture(*args):
        calls.append(args)
        return real(*args)

    setattr(torch.ops.triroute, name, capture)
    try:
        yield calls
    finally:
        setattr(torch.ops.triroute, name, real)


def fused_layers(model, on: bool):
    """`model` with each layer in one call (`triroute.decode_layer`) or op by op, the step's layers
    looped over (not in one call: `tests/inference/test_fused_step.py`)."""
    model.fused_step = False
    for layer in model.layers:
        layer.fused = on
    return model


def _prefilled(model, prompts, page_size=4):
    cache, states, rids = model.new_cache(page_size=page_size), [SideState() for _ in prompts], list(range(len(prompts)))
    for r in rids:
        cache.add_request(r)
    n = max(map(len, prompts))
    tokens = torch.zeros(len(prompts), n, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p)
    logits, _ = model.step(tokens, torch.tensor([len(p) for p in prompts]), states, cache, rids)
    return cache, states, rids, logits.argmax(-1)


def decode_steps(model, steps: int, around=contextlib.nullcontext, prices=None):
    """Two requests prefilled, then `steps` decode steps, each device step (`forward_step`) inside
    `around()`: yields each step's logits and what `around()` entered."""
    for logits, entered, _, _ in _decoded(model, steps, around, prices):
        yield logits, entered


def _decoded(model, steps: int, around=contextlib.nullcontext, prices=None):
    """`decode_steps`, each step also with its decisions (one `RouterOutput` per layer) and the cache."""
    cache, states, rids, last = _prefilled(model, [[3, 9, 4, 1, 7], [5, 2]])
    ones = torch.ones(2, dtype=torch.long)
    for _ in range(steps):
        batch = model.prepare(last.view(2, 1), ones, states, cache, rids, prices=prices)
        with around() as entered, torch.no_grad():
            logits, outs = model.forward_step(batch, cache)
        model.finish(batch, outs, cache, rids, None)
        last = logits.argmax(-1)
        yield logits, entered, outs, cache


PRICES = [(None, None), (None, [0.3, -0.2]), ([[0.3, -0.2], [-0.5, 1.0]], None)]
PRICE_IDS = ["unpriced", "the model's calibrated prices", "per-request prices"]


def _priced(model, prices, own):
    if own is not None:
        model.prices.copy_(torch.tensor(own, dtype=torch.float64))
    return None if prices is None else torch.tensor(prices, dtype=torch.float64)


@pytest.mark.parametrize("fused", ["step", True, False], ids=["one call per step", "one call per layer", "op by op"])
@pytest.mark.parametrize("prices,own", PRICES, ids=PRICE_IDS)
def test_a_decode_step_has_no_host_read_and_few_ops(prices, own, fused):
    model = fused_layers(tiny_model(), fused is not False)
    model.fused_step = fused == "step"
    L = model.config.model.n_layers
    step_prices = _priced(model, prices, own)
    for _, counter in decode_steps(model, 3, lambda: StepCounter(model_weights(model)), step_prices):
        assert counter.syncs == {}, counter.syncs
        assert counter.ops / L <= OPS_PER_LAYER, counter.ops / L
        if fused == "step":  # every layer's decisions and ops in one call (inference/fused_step.py)
            assert counter.foreign_ops == {"triroute.decode_layers": 1, "triroute.rms_norm": 1}, counter.foreign_ops
            assert counter.linear_kernels == {"triroute.decode_linear": 1}, counter.linear_kernels
            continue
        for op in DECISION_OPS:  # the one-call kernels ran, once per layer (not their fallbacks)
            assert counter.foreign_ops.get(op) == L, counter.foreign_ops
        for op in LAYER_OPS:
            assert counter.foreign_ops.get(op) == (None if fused else L), counter.foreign_ops
        assert counter.foreign_ops.get("triroute.decode_layer") == (L if fused else None), counter.foreign_ops
        # op by op two norms per layer; the final norm
        assert counter.foreign_ops.get("triroute.rms_norm") == (1 if fused else 2 * L + 1), counter.foreign_ops
        # every other weight matmul outside the experts by the decode kernel: O per layer, the LM head
        assert counter.linear_kernels == {"triroute.decode_linear": 1 if fused else L + 1}, counter.linear_kernels


@pytest.mark.parametrize("prices,own", PRICES, ids=PRICE_IDS)
def test_a_layer_in_one_call_equals_it_op_by_op_bit_for_bit(prices, own):
    """`triroute.decode_layer` against the layer's ops one by one (`InferenceLayer.forward`, its
    definition): the same logits every step, the same cache written (codes, scales, zeros,
    positions, counts, page tables) and the same executed counters, over decode steps whose heads
    skip, read locally (the window, 3, cuts the context) and read everything, at several widths."""
    runs = {}
    for fused in (False, True):
        model = fused_layers(tiny_model(seed=3), fused)
        logits, modes, widths = [], set(), set()
        for step_logits, _, outs, cache in _decoded(model, 8, prices=_priced(model, prices, own)):
            logits.append(step_logits)
            for out in outs:
                modes |= set(out.attn.hard.flatten().tolist())
                widths |= set(out.bits.hard.flatten().tolist())
        pools = [t for layer in cache.layers for group in layer.lists().tensors for t in group]
        runs[fused] = (logits, [*pools, cache.counts, cache.tables, cache.executed], modes, widths)
    (logits, state, modes, widths), (fused_logits, fused_state, _, _) = runs[False], runs[True]
    assert modes == {0, 1, 2} and len(widths) > 1, (modes, widths)  # every mode, more than one width
    for a, b in zip(logits, fused_logits):
        assert torch.equal(a, b)
    assert len(state) == len(fused_state)
    for a, b in zip(state, fused_state):
        assert torch.equal(a, b)


def _skipping(model, heads):
    """`model` whose layers' decisions skip `heads` for every row (the other heads as decided)."""
    for layer in model.layers:
        decide = layer.decide

        def skip(*args, _decide=decide, **kwargs):
            out = _decide(*args, **kwargs)
            out.attn.hard = out.attn.hard.clone()
            out.attn.hard[..., heads] = SKIP
            return out

        layer.decide = skip
    return model


def test_a_layer_in_one_call_with_heads_no_row_reads_equals_it_op_by_op():
    """Heads that every row of a step skips (the one-call layer computes no Q row of theirs, with
    `decode_qkv`'s read flags, `tests/kernels/test_layer_ops.py`): bit for bit the layer op by op,
    which computes them and multiplies their zero context."""
    runs = {}
    for fused in (False, True):
        model = _skipping(fused_layers(tiny_model(seed=3), fused), [0, 2])
        runs[fused] = [step_logits for step_logits, _, outs, _ in _decoded(model, 4)
                       if all(bool((out.attn.hard[..., [0, 2]] == SKIP).all()) for out in outs)]
    assert len(runs[False]) == len(runs[True]) == 4
    for a, b in zip(runs[False], runs[True]):
        assert torch.equal(a, b)


def test_a_layer_in_one_call_refuses_a_mode_it_does_not_know_before_writing():
    model = fused_layers(tiny_model(), True)
    cache, states, rids, last = _prefilled(model, [[3, 9, 4, 1, 7], [5, 2]])
    batch = model.prepare(last.view(2, 1), torch.ones(2, dtype=torch.long), states, cache, rids)
    layer = model.layers[0]
    with torch.no_grad():
        x = model.embed(batch.tokens)
        state = RoutingState.initial(model.config, 2, 1, x.device)
        out = layer.decide(x, torch.cat([batch.side, state.decisions], -1), None, batch.positions, None)
        out.attn.hard = torch.full_like(out.attn.hard, 3)
        before = [t.clone() for t in (cache.counts, *cache.layers[0].lists().tensors[0])]
        with pytest.raises(RuntimeError, match="mode 3 is not one of the 3 modes"):
            layer(x, out, batch, cache)
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.counts, *cache.layers[0].lists().tensors[0])))


def test_the_one_call_layers_schema_names_what_it_writes():
    """`torch.library.opcheck` on a decode step's real arguments: the op writes only the arguments
    its schema marks as written (the counts, the pools, the executed counters), and its fake kernel
    gives the output's shape."""
    model = fused_layers(tiny_model(), True)
    cache, states, rids, last = _prefilled(model, [[3, 9, 4, 1, 7], [5, 2]], page_size=16)
    batch = model.prepare(last.view(2, 1), torch.ones(2, dtype=torch.long), states, cache, rids)
    with captured_calls("decode_layer") as captured, torch.no_grad():
        model.forward_step(batch, cache)
    assert len(captured) == model.config.model.n_layers
    torch.library.opcheck(torch.ops.triroute.decode_layer.default, captured[0],
                          test_utils=("test_schema", "test_faketensor"))


def test_the_scheduler_reads_the_device_once_per_page_of_steps_and_holds_little_slack():
    model = tiny_model()
    P = 4
    cache, states, rids, last = _prefilled(model, [[3, 9, 4, 1, 7], [5, 2]], page_size=P)
    reads = cache.host_reads
    steps = 4 * P
    for _ in range(steps):
        logits, _ = model.step(last.view(2, 1), torch.ones(2, dtype=torch.long), states, cache, rids)
        last = logits.argmax(-1)
    assert cache.host_reads - reads <= steps // P  # one read (for every request at once) per P steps at most
    cache.sync(rids)
    for rid in rids:
        for entries in cache.requests[rid]:
            for e in entries:  # room for the next page of tokens, nothing more
                assert len(e.pages) * P - e.count < 2 * P


def test_a_token_the_device_append_lost_is_refused_at_the_next_read():
    """The Triton append (a GPU's) reads nothing back: a token that found no reserved page is
    counted on the device, and the scheduler's next read of the counts refuses the cache."""
    model = tiny_model()
    cache, states, rids, last = _prefilled(model, [[3, 9, 4, 1, 7], [5, 2]], page_size=4)
    cache.sync(rids)  # nothing lost
    cache.lost += 1
    with pytest.raises(RuntimeError, match="1 decoded token.*not written.*scheduler bug"):
        cache.sync(rids)
