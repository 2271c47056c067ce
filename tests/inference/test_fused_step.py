"""A decode step's layers in one call (`triroute.decode_layers`, `inference/fused_step.py`) against
the layer loop (`InferenceModel.forward_step`'s definition, each layer one call and op by op): the
same logits, decisions, cache and executed counters bit for bit, unpriced and priced, whitened heads
with running statistics and without, token-granular attention, replayed decisions; where it is taken
and where the loop runs."""

import pytest
import torch

from triroute_kernels.cpu_ops import cpu_ops_available, cpu_ops_error

from megatron_triroute.inference.fused_step import LayerDecisions, fusable
from megatron_triroute.routing.controller import TriRouteController
from tests.benchmarks import load_benchmark
from tests.inference.test_decode_step import PRICE_IDS, PRICES, _decoded, _prefilled, _priced, captured_calls
from tests.inference.test_engine import tiny_model


def _model(seed=3, **router):
    model = tiny_model(seed=seed, **router)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # whitening statistics away from their initial (0, 1), so the fold matters
        for name, b in model.named_buffers():
            if name.endswith("whiten.mean"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
            elif name.endswith("whiten.var"):
                b.copy_(torch.rand(b.shape, generator=g) * 2 + 0.1)
    return model


def _mode(model, mode):
    model.fused_step = mode == "step"
    for layer in model.layers:
        layer.fused = mode != "op by op"
    return model


def _run(model, steps=6, prices=None):
    logits, decisions = [], []
    for step_logits, _, outs, cache in _decoded(model, steps, prices=prices):
        logits.append(step_logits)
        decisions.append([(o.attn.hard, o.bits.hard, o.experts.index, o.experts.weight, o.experts.probs,
                           o.experts.option, o.decision_block.features) for o in outs])
    pools = [t for layer in cache.layers for group in layer.lists().tensors for t in group]
    return logits, decisions, [*pools, cache.counts, cache.tables, cache.executed]


def _assert_same(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert len(a[1]) == len(b[1])
    for step_a, step_b in zip(a[1], b[1]):
        for la, lb in zip(step_a, step_b):
            for x, y in zip(la, lb):
                assert torch.equal(x, y)
    assert len(a[2]) == len(b[2])
    for x, y in zip(a[2], b[2]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("prices,own", PRICES, ids=PRICE_IDS)
@pytest.mark.parametrize("router", [{}, {"whitening": False}, {"attn_granularity": "token"}],
                         ids=["whitened", "no whitening", "token-granular attention"])
def test_the_step_in_one_call_equals_the_layer_loop_bit_for_bit(prices, own, router):
    runs = {}
    for mode in ("step", "layer", "op by op"):
        model = _mode(_model(**router), mode)
        runs[mode] = _run(model, prices=_priced(model, prices, own))
    modes = {int(m) for step in runs["step"][1] for layer in step for m in layer[0].flatten()}
    assert modes == {0, 1, 2}, modes  # every attention mode was taken
    _assert_same(runs["layer"], runs["step"])
    _assert_same(runs["op by op"], runs["step"])


def test_the_one_call_is_taken_only_where_the_loop_would_call_the_same_kernels():
    def decode_batch(model):
        cache, states, rids, last = _prefilled(model, [[3, 9, 4, 1, 7], [5, 2]])
        batch = model.prepare(last.view(2, 1), torch.ones(2, dtype=torch.long), states, cache, rids)
        return batch, model.embed(batch.tokens)

    model = _model()
    batch, x = decode_batch(model)
    assert fusable(model, batch, x)
    assert not fusable(model, batch, x.expand(2, 3, x.shape[-1]))  # several tokens per request
    assert not fusable(model, batch, x.double())  # not the kernels' float32
    model.layers[1].fused = False  # op by op asked for
    assert not fusable(model, batch, x)
    model.layers[1].fused = True
    model.layers[0].decide = lambda *args: None  # a layer's decisions taken elsewhere
    assert not fusable(model, batch, x)
    grouped = _model(attn_granularity="layer_group", layer_group_size=2)  # a follower reuses its leader's
    batch, x = decode_batch(grouped)
    assert not fusable(grouped, batch, x)


def test_a_decode_step_takes_the_one_call_and_a_prefill_the_loop():
    model = _model()
    with captured_calls("decode_layers") as calls:
        for _, _, outs, _ in _decoded(model, 3):
            assert isinstance(outs, LayerDecisions) and len(outs) == model.config.model.n_layers
    assert len(calls) == 3  # the decode steps; the prefill (5 and 2 tokens) ran the loop
    last = outs[len(outs) - 1]
    assert outs[-1] is last and outs[-len(outs)] is outs[0] and outs[1:] == [last]  # made once, any index
    assert torch.equal(last.bits.hard, last.bits.y.argmax(-1)) and last.decision_block.holds(last)
    with pytest.raises(IndexError):
        outs[len(outs)]


class Replaying(torch.nn.Module):
    """A controller that replays decisions drawn elsewhere, the real one running beside."""

    def __init__(self, real, schedule):
        super().__init__()
        self.real, self.schedule = real, list(schedule)

    def next_decisions(self):
        return self.schedule.pop(0)

    def forward(self, hidden, side, noise_key=None, tau=1.0, prev=None, decide=True):
        self.real(hidden, side, noise_key, tau, prev, **({} if decide else {"decide": False}))
        return self.next_decisions()


@pytest.mark.parametrize("router", [{}, {"attn_granularity": "token"}], ids=["per head", "one mode per token"])
def test_replayed_decisions_run_in_one_call_as_in_the_loop(router):
    """Another model's decisions (seed 5), replayed into this one's decode steps (seed 3): the one call
    runs them as the layer loop does (one mode per token: every head's), and runs the real controller too."""
    steps = 5
    recorded = [outs for _, _, outs, _ in _decoded(_mode(_model(seed=5, **router), "layer"), steps)]
    runs = {}
    for mode in ("step", "layer"):
        model = _mode(_model(seed=3, **router), mode)
        cache, states, rids, last = _prefilled(model, [[3, 9, 4, 1, 7], [5, 2]])
        for i, layer in enumerate(model.layers):
            layer.controller = Replaying(layer.controller, [step[i] for step in recorded])
        logits, ran = [], []
        real_forward = TriRouteController.forward

        def counted(self, *args, **kwargs):
            ran.append(1)
            return real_forward(self, *args, **kwargs)

        TriRouteController.forward = counted
        try:
            for _ in range(steps):
                batch = model.prepare(last.view(2, 1), torch.ones(2, dtype=torch.long), states, cache, rids)
                with torch.no_grad():
                    step_logits, outs = model.forward_step(batch, cache)
                model.finish(batch, outs, cache, rids, None)
                last = step_logits.argmax(-1)
                logits.append(step_logits)
                assert len(outs) == len(recorded[0]) and all(a is b for a, b in zip(outs, recorded[len(logits) - 1]))
        finally:
            TriRouteController.forward = real_forward
        assert all(not layer.controller.schedule for layer in model.layers)
        pools = [t for layer in cache.layers for group in layer.lists().tensors for t in group]
        runs[mode] = (logits, pools + [cache.counts, cache.executed], len(ran))
    assert runs["layer"][2] == steps * len(recorded[0]) and runs["step"][2] == 0  # the call ran them in C++
    for a, b in zip(runs["layer"][0], runs["step"][0]):
        assert torch.equal(a, b)
    for a, b in zip(runs["layer"][1], runs["step"][1]):
        assert torch.equal(a, b)
    own = [o for o in _run(_mode(_model(seed=3, **router), "step"), steps)[0]]
    assert any(not torch.equal(a, b) for a, b in zip(own, runs["step"][0]))  # the replayed decisions mattered


def test_the_one_call_folds_the_heads_again_after_they_change():
    """The folded heads are kept in the call between steps while their inputs are unchanged: a head's
    bias, gain or whitening statistics written in place (as a load does), or a projection replaced,
    is folded again, as the layer loop does (bit for bit)."""
    runs = {}
    for mode in ("step", "layer"):
        model = _mode(_model(), mode)
        logits = []
        for i, (step_logits, _, _, _) in enumerate(_decoded(model, 6)):
            logits.append(step_logits)
            heads = model.layers[0].controller.heads
            with torch.no_grad():
                if i == 1:
                    heads["experts"].bias.add_(torch.tensor([0.0, 2.0, -1.0, 0.0, 0.5]))
                if i == 2:
                    heads["attn"].whiten.var.mul_(4.0)
                if i == 3:
                    heads["bits"].gain.mul_(-1.0)
                if i == 4:
                    heads["bits"].proj.weight = torch.nn.Parameter(heads["bits"].proj.weight.flip(0).clone())
        runs[mode] = logits
    changed = [not torch.equal(a, b) for a, b in zip(runs["step"], _run(_mode(_model(), "step"), 6)[0])]
    assert any(changed[2:])  # the writes changed the steps after them
    for a, b in zip(runs["layer"], runs["step"]):
        assert torch.equal(a, b)


def test_the_one_call_reads_again_what_was_replaced_between_steps():
    """What the call reads from the modules is read once and kept (`fused_step._Plan`): a parameter
    assigned, or a buffer replaced in its module's table as `Module.to` does (no registration hook
    sees that), between steps is read again; so are the cache's tables and pools after the cache
    reallocates them. Bit for bit the layer loop, which reads everything at every step."""
    runs, layouts = {}, {}
    for mode in ("step", "layer"):
        model = _mode(_model(), mode)
        logits, seen = [], []
        for i, (step_logits, _, _, cache) in enumerate(_decoded(model, 6)):
            logits.append(step_logits)
            seen.append(cache.layout)
            layer = model.layers[1]
            with torch.no_grad():
                if i == 0:
                    layer.wq = torch.nn.Parameter(layer.wq.flip(0).clone())
                if i == 1:
                    layer.experts[0].w2.weight = torch.nn.Parameter(layer.experts[0].w2.weight * 3.0)
                if i == 2:  # the cache reallocates at a later step (asserted below), with nothing replaced
                    stats = layer.controller.heads["experts"].whiten
                    stats._buffers["mean"] = stats.mean + 2.0
        pools = [t for layer in cache.layers for group in layer.lists().tensors for t in group]
        runs[mode], layouts[mode] = (logits, [], [*pools, cache.counts, cache.tables, cache.executed]), seen
    assert layouts["step"][-1] > layouts["step"][3]  # the cache reallocated between later decode steps
    unchanged = _run(_mode(_model(), "step"), 6)[0]
    assert all(not torch.equal(a, b) for a, b in zip(runs["step"][0][1:], unchanged[1:]))  # every replacement mattered
    _assert_same(runs["layer"], runs["step"])


def test_the_cache_holds_nothing_of_the_models():
    """The cache keeps its own tensors' list for the call (`PagedKVCache.decode_state`), not the
    model's: what it holds is its own bytes (the decode benchmark's resident KV bytes walk it)."""
    model = _mode(_model(), "step")
    for _, _, _, cache in _decoded(model, 3):
        pass
    held = set(load_benchmark("bench_decode").reachable_storages(cache))  # what its resident bytes count
    assert cache.decode_state() and all(t.untyped_storage().data_ptr() in held for t in cache.decode_state())
    model_storages = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert not held & model_storages


def test_the_one_call_schema_names_what_it_writes():
    """`torch.library.opcheck` on a decode step's real arguments: the call writes only what its schema
    marks as written (the counts, pools, executed counters and the folded heads' cache), and its fake
    kernel gives the outputs' shapes and dtypes."""
    assert cpu_ops_available(), cpu_ops_error()  # loads the library: the op exists before it is captured
    with captured_calls("decode_layers") as captured:
        for _ in _decoded(_model(), 1):
            pass
    assert len(captured) == 1
    torch.library.opcheck(torch.ops.triroute.decode_layers.default, captured[0],
                          test_utils=("test_schema", "test_faketensor"))


def test_the_folded_heads_made_under_inference_mode_are_folded_again_outside_it():
    """A model first served under `torch.inference_mode` (an evaluation harness), then, its heads
    changed, under `no_grad`: the call folds them again, as the layer loop does."""
    runs = {}
    for mode in ("step", "layer"):
        model = _mode(_model(), mode)
        with torch.inference_mode():
            first = [step_logits for step_logits, *_ in _decoded(model, 2)]
        with torch.no_grad():
            model.layers[1].controller.heads["experts"].bias.add_(torch.tensor([0.0, 3.0, -2.0, 0.0, 1.0]))
        runs[mode] = first + [step_logits for step_logits, *_ in _decoded(model, 2)]
    for a, b in zip(runs["layer"], runs["step"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("router", [{}, {"attn_granularity": "token"}], ids=["per-head attention", "token-granular attention"])
def test_the_audit_reads_the_calls_decisions_as_the_layer_loops(router):
    """`LayerDecisions.hard_stacks` (the call's tensors, no `RouterOutput` made) equals stacking each
    layer's `RouterOutput`, and a step's audit counts the same either way."""
    from megatron_triroute.inference.audit import CostAudit
    from megatron_triroute.inference.model import hard_stacks
    from tests.inference.test_decode_step import _prefilled

    audits = {}
    for mode in ("step", "layer"):
        model = _mode(_model(**router), mode)
        cache, states, rids, last = _prefilled(model, [[3, 9, 4, 1, 7], [5, 2]])
        audit = CostAudit(model.config.model.n_layers)
        for _ in range(4):
            batch = model.prepare(last.view(2, 1), torch.ones(2, dtype=torch.long), states, cache, rids, audit)
            with torch.no_grad():
                logits, outs = model.forward_step(batch, cache)
            if mode == "step":
                assert isinstance(outs, LayerDecisions)
                for fused, loop in zip(outs.hard_stacks(), hard_stacks(list(outs))):
                    assert torch.equal(fused, loop)
            model.finish(batch, outs, cache, rids, audit)
            last = logits.argmax(-1)
        audits[mode] = audit
    assert audits["step"].layers == audits["layer"].layers and audits["step"].requests == audits["layer"].requests
    assert audits["step"].total("attn") > 0 and audits["step"].total("experts") > 0
