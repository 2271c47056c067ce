"""The attention-mode contract (routing/modes.py) against hand-written ranges."""

import torch

from megatron_triroute.routing.modes import ATTN_MODES, FULL, LOCAL, N_MODES, READING_MODES, SKIP, keys_read, read_mask, read_start


def test_each_mode_reads_its_hand_written_range():
    window = 2
    t = torch.arange(6)
    assert read_start(t, SKIP, window).tolist() == [1, 2, 3, 4, 5, 6]  # empty: start past the query
    assert read_start(t, LOCAL, window).tolist() == [0, 0, 0, 1, 2, 3]  # max(0, t - w)
    assert read_start(t, FULL, window).tolist() == [0] * 6
    mixed = torch.tensor([SKIP, LOCAL, FULL, LOCAL, SKIP, FULL])
    assert read_start(t, mixed, window).tolist() == [1, 0, 0, 1, 5, 0]


def test_counts_and_masks_agree_with_the_ranges():
    window, T = 3, 9
    counts = keys_read(torch.arange(T), window)  # (T, N_MODES)
    assert counts.shape == (T, N_MODES) and counts.dtype == torch.float64
    assert counts[:, SKIP].tolist() == [0.0] * T
    assert counts[:, LOCAL].tolist() == [float(min(t, window) + 1) for t in range(T)]
    assert counts[:, FULL].tolist() == [float(t + 1) for t in range(T)]
    for mode in range(N_MODES):
        mask = read_mask(T, mode, window)
        assert mask.sum(1).tolist() == counts[:, mode].long().tolist()
        assert not bool(mask.triu(1).any())  # causal
    assert READING_MODES == tuple(m for m in range(len(ATTN_MODES)) if ATTN_MODES[m] != "skip")


def test_every_mode_at_once_equals_each_mode_s_read_start():
    positions = torch.tensor([[0, 1, 5, 130], [7, 2, 2048, 3]])
    for window in (0, 3, 128):
        starts = read_start(positions, None, window)
        assert torch.equal(starts, torch.stack([read_start(positions, m, window) for m in range(N_MODES)], -1))
        t = positions.to(torch.float64)
        assert torch.equal(keys_read(positions, window),
                           torch.stack([t + 1.0 - read_start(t, m, window) for m in range(N_MODES)], -1))


def test_reads_of_int_modes_and_of_every_mode_never_read_a_value_back():
    from tests.benchmarks import load_benchmark

    counter = load_benchmark("op_counter").StepCounter()
    positions = torch.arange(8)
    with counter:
        keys_read(positions, 3)
        read_start(positions, LOCAL, 3)
        read_mask(8, FULL, 3)
    assert counter.host_syncs == 0, counter.syncs  # (a 0-d index tensor is read back: a device sync on a GPU)
