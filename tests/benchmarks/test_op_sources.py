import torch
from torch.utils.module_tracker import ModuleTracker

from megatron_triroute.routing.losses import router_z_loss
from tests.benchmarks import load_benchmark


class _ZLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3, bias=False)

    def forward(self, x):
        return router_z_loss(self.proj(x))


def test_ops_are_attributed_to_their_phase_and_source():
    ops = load_benchmark("op_sources")
    model, x = _ZLoss(), torch.randn(5, 4)
    tracker = ModuleTracker()
    counter = ops.SourceCounter(tracker)
    with tracker, counter:
        loss = model(x)
        loss.backward()
        torch.zeros(2).add_(1.0)  # outside the model: the step's own work
    c = counter.counts
    z_loss = {op for (phase, source, op) in c if phase == "forward" and source.endswith("losses.py:router_z_loss")}
    assert {"aten.logsumexp", "aten.pow", "aten.mean"} <= z_loss, c
    assert ("forward", "?", "aten.mm") in c  # the Linear: no source of ours on the stack
    assert any(phase == "backward" and source == "LogsumexpBackward0" for phase, source, _ in c), c
    assert ("step", "?", "aten.add_") in c
    assert ops.group("forward", "megatron_triroute/routing/losses.py:router_z_loss") == "forward: balancing losses"
    assert ops.group("backward", "MmBackward0") == "backward (autograd nodes)"
    assert ops.group("step", "megatron/core/optimizer/distrib_optimizer.py:copy_group_grads").startswith("step: optimizer")


def test_bytes_count_arguments_and_results_and_views_move_none():
    """An elementwise op moves its inputs' and its result's bytes; a view moves none."""
    ops = load_benchmark("op_sources")
    x = torch.randn(8, 16)  # 512 bytes
    tracker = ModuleTracker()
    counter = ops.SourceCounter(tracker)
    with tracker, counter:
        y = x * 2.0  # reads 512, writes 512
        y.view(16, 8).t()  # views
        y.sum()  # reads 512, writes 4
    moved = {op: n for (_, _, op), n in counter.bytes.items()}
    assert moved == {"aten.mul": 1024, "aten.sum": 516}, moved
