"""One decode step is static: no host read, one call per layer of each kernel op, and at most
`OPS_PER_LAYER` top-level aten ops per layer (issue target; with zero and nonzero prices: the
model's calibrated ones or each request's own), counted by dispatching it under
`benchmarks.op_counter.StepCounter`. The scheduler reads the device counts once per page of
decode steps, and a request holds at most two unfilled pages per pool."""

import contextlib

import pytest
import torch

from benchmarks.op_counter import StepCounter, model_weights
from megatron_triroute.inference.side_state import SideState
from tests.inference.test_engine import tiny_model

OPS_PER_LAYER = 120
"""The target, priced or not (measured 41-44 on this 2-layer model, priced or not: the
priced argmax of the three axes is the same one call as the plain one, `triroute.decode_decisions`,
with the step's price shifts, computed on the host once per step)."""
KERNEL_OPS = ("triroute.paged_attention", "triroute.cache_append", "triroute.routed_experts",
              "triroute.controller_logits", "triroute.decode_qkv", "triroute.decode_decisions")


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
    cache, states, rids, last = _prefilled(model, [[3, 9, 4, 1, 7], [5, 2]])
    ones = torch.ones(2, dtype=torch.long)
    for _ in range(steps):
        batch = model.prepare(last.view(2, 1), ones, states, cache, rids, prices=prices)
        with around() as entered, torch.no_grad():
            logits, outs = model.forward_step(batch, cache)
        model.finish(batch, outs, cache, rids, None)
        last = logits.argmax(-1)
        yield logits, entered


@pytest.mark.parametrize("prices,own", [(None, None), (None, [0.3, -0.2]), ([[0.3, -0.2], [-0.5, 1.0]], None)],
                         ids=["unpriced", "the model's calibrated prices", "per-request prices"])
def test_a_decode_step_has_no_host_read_and_few_ops(prices, own):
    model = tiny_model()
    if own is not None:
        model.prices.copy_(torch.tensor(own, dtype=torch.float64))
    L = model.config.model.n_layers
    step_prices = None if prices is None else torch.tensor(prices, dtype=torch.float64)
    for _, counter in decode_steps(model, 3, lambda: StepCounter(model_weights(model)), step_prices):
        assert counter.syncs == {}, counter.syncs
        assert counter.ops / L <= OPS_PER_LAYER, counter.ops / L
        for op in KERNEL_OPS:  # the one-call kernels ran, once per layer (not their fallbacks)
            assert counter.foreign_ops.get(op) == L, counter.foreign_ops
        assert counter.foreign_ops.get("triroute.rms_norm") == 2 * L + 1  # two per layer, the final norm
        # every other weight matmul outside the experts by the decode kernel: O per layer, the LM head
        assert counter.linear_kernels == {"triroute.decode_linear": L + 1}, counter.linear_kernels


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
