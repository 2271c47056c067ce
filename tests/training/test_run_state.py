"""Restoring the learning-rate schedule across optimizer engines that group parameters differently
(run_state.restore_learning_rate, load_scheduler_state): hand-checked on torch's LambdaLR."""

import math

import pytest
import torch

from megatron_triroute.checkpoint import CheckpointError
from megatron_triroute.training.run_state import load_scheduler_state, restore_learning_rate


def _scheduler(n_groups: int, lr: float = 0.1):
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(n_groups)]
    optimizer = torch.optim.SGD([{"params": [p]} for p in params], lr=lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)


def test_a_two_group_schedule_continues_on_four_groups():
    old_opt, old = _scheduler(2)
    for _ in range(3):
        old_opt.step()
        old.step()
    assert old.get_last_lr() == [pytest.approx(0.1 * 0.5 ** 3)] * 2
    saved_groups = [{k: v for k, v in g.items() if k != "params"} for g in old_opt.param_groups]
    new_opt, new = _scheduler(4, lr=0.7)  # another engine: four groups, a fresh schedule
    restore_learning_rate(new_opt.param_groups, saved_groups, "ckpt")
    load_scheduler_state(new, old.state_dict(), "ckpt")
    assert [g["lr"] for g in new_opt.param_groups] == [pytest.approx(0.1 * 0.5 ** 3)] * 4
    assert [g["initial_lr"] for g in new_opt.param_groups] == [0.1] * 4
    new_opt.step()
    new.step()
    assert new.last_epoch == 4
    assert [g["lr"] for g in new_opt.param_groups] == [pytest.approx(0.1 * 0.5 ** 4)] * 4
    assert math.isclose(new.get_last_lr()[3], 0.1 * 0.5 ** 4)


def test_groups_with_different_rates_are_refused():
    opt, sched = _scheduler(2)
    saved = [{"lr": 0.1, "initial_lr": 0.1}, {"lr": 0.2, "initial_lr": 0.2}]
    with pytest.raises(CheckpointError, match="different learning rates"):
        restore_learning_rate(opt.param_groups, saved, "ckpt")
    state = sched.state_dict()
    state["base_lrs"] = [0.1, 0.2]
    _, four = _scheduler(4)
    with pytest.raises(CheckpointError, match="base_lrs differ between groups"):
        load_scheduler_state(four, state, "ckpt")
