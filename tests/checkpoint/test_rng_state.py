"""capture_rng_state / restore_rng_state reproduce every global generator, through a checkpoint."""

import random

import numpy as np
import torch

from megatron_triroute.checkpoint import capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint


def _draw():
    return (
        [random.random() for _ in range(3)] + [random.gauss(0, 1)],
        np.random.rand(3).tolist() + [np.random.standard_normal()],
        torch.rand(3).tolist() + torch.randn(1).tolist(),
    )


def test_rng_round_trip_through_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    random.gauss(0, 1)  # leaves a cached Gaussian in python's state
    np.random.standard_normal()  # and in numpy's
    save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()}, {})
    expected = _draw()

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draw() != expected
    _, tree, _ = load_checkpoint(tmp_path)
    restore_rng_state(tree["rng"])
    assert _draw() == expected


def test_capture_is_a_snapshot():
    state = capture_rng_state()
    first = _draw()
    restore_rng_state(state)
    assert _draw() == first
