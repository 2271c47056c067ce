"""Tensor x expert parallel on 4 processes trains like one process: same routing decisions, same
reduced gradients, same parameters after plain SGD steps.

Layouts (4 ranks): TP2 x EP2 (dp = edp = 2), TP1 x EP2 (dp 4, edp 2) and TP2 x EP4 (dp 2, edp 1).
In the last two the expert gradients' two candidate scalings, 1/dp and 1/edp, differ, so a wrong
scaling of the expert-data-parallel reduction changes the expert gradients by a factor 2.
SGD (no momentum, no clipping) keeps each update a fixed multiple of the gradient, so any gradient
difference shows up as a parameter difference on the next step instead of being normalised away.
"""

import re

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, by_global_expert, decision_margin, tiny_triroute

STEPS = 2
MICRO_BATCHES = 4  # global batch: 4 sequences, one per micro-batch, split over the data-parallel ranks
LR = 0.5
LAYOUTS = ((2, 2), (1, 2), (2, 4))  # (tp, ep) on 4 ranks
_EXPERT = re.compile(r".*moe\.experts\.\d+\.w[123]\.weight")  # one global expert's (by_global_expert)


def _micro_batch(cfg, i):
    from megatron_triroute.training.engine import MicroBatch

    tokens, labels, idx = batch(cfg, n=1, seed=40 + i, offset=i)
    return MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)


class _RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of the gradients it applied at each step."""

    def __init__(self, named, lr):
        self.named = list(named)
        super().__init__([p for _, p in self.named], lr=lr)
        self.applied: list[dict[str, torch.Tensor]] = []

    def step(self, closure=None):
        self.applied.append({n: p.grad.detach().clone() for n, p in self.named})
        return super().step(closure)


def _train(cfg, tp, ep):
    """Run STEPS steps; return this rank's decisions per global micro-batch, its gradients per step
    and final parameters (TP shards gathered, experts under their global index), and the losses."""
    from megatron.core import parallel_state

    from megatron_triroute.parallel import destroy_parallel
    from megatron_triroute.training.engine import TrainEngine

    model, groups = build(cfg, tp=tp, ep=ep, seed=3)
    assert (groups.tp, groups.ep) == (tp, ep)
    outs = []
    hooks = [layer.controller.register_forward_hook(lambda m, a, out: outs.append(out))
             for layer in model.decoder.layers]
    opt = _RecordingSGD(model.named_parameters(), LR)
    engine = TrainEngine(model, groups, opt, total_steps=10, clip_grad=0.0)
    decisions, losses, norms = {}, [], []
    for step in range(STEPS):
        mine = list(range(MICRO_BATCHES))[groups.dp_rank::groups.dp]
        outs.clear()
        report = engine.train_step([_micro_batch(cfg, step * MICRO_BATCHES + i) for i in mine], step)
        assert not report.skipped
        losses.append(report.loss)
        norms.append(report.grad_norm)
        for j, i in enumerate(mine):
            per_layer = outs[j * cfg.model.n_layers:(j + 1) * cfg.model.n_layers]
            decisions[(step, i)] = [
                (o.attn.y.detach(), o.bits.y.detach(), o.experts.index.clone(), o.experts.weight.detach(),
                 o.attn.logits.detach(), o.bits.logits.detach(), o.experts.probs.detach()) for o in per_layer]
    for h in hooks:
        h.remove()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    e_local = cfg.router.num_experts // ep
    named = dict(model.named_parameters())

    def full(name, t):
        p = named[name]
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = torch.cat(parts, p.partition_dim)
        return by_global_expert(name, t, groups.ep_rank * e_local)  # local expert i: global ep_rank * E_local + i

    grads = [{k: v for n, g in applied.items() for k, v in full(n, g).items()} for applied in opt.applied]
    params = {k: v for n, p in named.items() for k, v in full(n, p.detach()).items()}
    destroy_parallel()
    return decisions, grads, params, losses, norms


def _reference(rank, world_size, path):
    cfg = tiny_triroute()
    decisions, grads, params, losses, norms = _train(cfg, 1, 1)
    margin = min(decision_margin(cfg, decisions[(s, i)], step=s,
                                 idx=_micro_batch(cfg, s * MICRO_BATCHES + i).sample_index)
                 for s, i in decisions)
    assert margin > 1e-4, f"near-tie decision ({margin}): pick another seed"
    torch.save({"decisions": decisions, "grads": grads, "params": params, "losses": losses, "norms": norms}, path)


def _layouts(rank, world_size, path):
    cfg = tiny_triroute()
    ref = torch.load(path, weights_only=True)
    for tp, ep in LAYOUTS:
        decisions, grads, params, losses, norms = _train(cfg, tp, ep)
        where = f"tp={tp} ep={ep} rank={rank}"
        assert decisions, where
        for key, layers in decisions.items():
            for layer, (got, want) in enumerate(zip(layers, ref["decisions"][key])):
                for what, x, y in zip(("attn", "bits", "experts"), got[:3], want[:3]):
                    assert torch.equal(x, y), (where, key, layer, what)
                assert torch.allclose(got[3], want[3], atol=1e-5), (where, key, layer, "expert weights")
        experts_seen = 0
        for step, (got, want) in enumerate(zip(grads, ref["grads"])):
            for name, g in got.items():
                assert name in want, (where, name)
                experts_seen += bool(_EXPERT.match(name))
                assert torch.allclose(g, want[name], atol=1e-5, rtol=1e-4), (
                    where, step, name, (g - want[name]).abs().max().item(), want[name].abs().max().item())
        assert experts_seen >= STEPS * cfg.router.num_experts // ep, (where, experts_seen)
        assert any(_EXPERT.match(n) and g.abs().max() > 1e-4 for got in grads for n, g in got.items()), where
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref["losses"]), atol=1e-5, rtol=0), (where, losses, ref["losses"])
        assert torch.allclose(torch.tensor(norms), torch.tensor(ref["norms"]), atol=1e-5, rtol=1e-5), (where, norms)
        for name, p in params.items():
            assert torch.allclose(p, ref["params"][name], atol=1e-5), (where, name)


@pytest.mark.distributed
def test_tp_ep_layouts_match_single_process_decisions_and_gradients(tmp_path):
    path = str(tmp_path / "ref.pt")
    run_distributed(_reference, 1, path, timeout=240)
    run_distributed(_layouts, 4, path, timeout=500)
