"""benchmarks/bench_cpu_ops.py's head ranges: every head full, or the budget mix's modes."""

import pytest
import torch

from benchmarks.forced_decisions import budget_mix
from megatron_triroute.training.recipes import get_recipe
from tests.benchmarks import load_benchmark


def test_mixed_heads_take_the_budget_mix_modes_and_their_first_keys():
    bench = load_benchmark("bench_cpu_ops")
    head_ranges, H = bench.head_ranges, bench.H
    context, batch = 2048, 64
    config = get_recipe("160m").triroute.validate()
    assert not head_ranges("full", 2, context, torch.Generator()).any()
    lo = head_ranges("mixed", batch, context, torch.Generator().manual_seed(0))
    assert lo.shape == (batch, H)
    skip, local, full = context, context - 1 - config.router.window, 0  # by hand: rows at position context - 1
    assert set(lo.unique().tolist()) == {skip, local, full}
    drawn = torch.tensor([(lo == v).float().mean() for v in (skip, local, full)])
    want = torch.tensor(budget_mix(config, context)["attn"], dtype=torch.float32)
    assert (drawn - want).abs().max() < 0.05, (drawn, want)


def test_a_cache_of_chosen_widths_holds_every_position_once_and_cached_tables_stay_in_the_first_pages():
    bench = load_benchmark("bench_cpu_ops")
    batch, context = 2, 100
    k_pools, v_pools, tables = bench.build_cache(batch, context, torch.Generator().manual_seed(0), (2, 16))
    assert [p.bits for p in k_pools] == [2, 16] and tables.shape[:2] == (2, batch)
    for b in range(batch):  # each position in exactly one page of one pool, by the request's own table
        held = torch.cat([k_pools[w].token_pos[tables[w, b][tables[w, b] >= 0]].flatten() for w in range(2)])
        assert sorted(held[held >= 0].tolist()) == list(range(context))
    cached = bench.cached_tables(tables, 3)
    assert torch.equal(cached < 0, tables < 0)  # no page entry added or dropped
    assert cached.max() < 3 and torch.equal(cached[tables >= 0], tables[tables >= 0] % 3)


def test_interleaved_times_each_side_and_gives_the_ratio_of_the_first_to_the_second():
    import time

    bench = load_benchmark("bench_cpu_ops")
    calls = []
    slow, fast, ratio = bench.interleaved(lambda c: (calls.append("a"), time.sleep(0.004)),
                                          lambda c: calls.append("b"), iters=4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # A B, then B A
    assert slow >= 0.004 > fast and ratio[0] <= ratio[1] <= ratio[2] and ratio[0] > 1


def test_interleaved_runs_its_before_hook_untimed_ahead_of_every_call():
    import time

    bench = load_benchmark("bench_cpu_ops")
    calls = []
    a, b, _ = bench.interleaved(lambda c: calls.append("a"), lambda c: calls.append("b"), iters=2,
                                before=lambda: (calls.append("-"), time.sleep(0.01)))
    assert calls == ["-", "a", "-", "b", "-", "b", "-", "a"]
    assert a < 0.01 and b < 0.01  # the hook's time is not the calls'


def test_the_evictor_holds_its_megabytes_never_writes_them_and_is_off_at_0():
    bench = load_benchmark("bench_cpu_ops")
    assert bench.Evictor(0).buffer is None
    evict = bench.Evictor(2)
    assert evict.buffer.nbytes == 2 * 2**20
    before = evict.buffer.clone()
    evict()
    assert torch.equal(evict.buffer, before)  # read, never written: no dirty lines to write back


@pytest.mark.parametrize("argv, message", [
    (["--evict-mb", "-1"], "--evict-mb -1"),
    (["--evict-mb", "64"], "add --baseline REV or --cached-pages N"),  # nothing it would apply to
    (["--cached-pages", "-2"], "--cached-pages -2"),
])
def test_the_cli_refuses_what_it_cannot_use(monkeypatch, capsys, argv, message):
    monkeypatch.setattr("sys.argv", ["bench_cpu_ops.py", *argv])
    with pytest.raises(SystemExit) as stop:
        load_benchmark("bench_cpu_ops").main()
    assert stop.value.code == 2 and message in capsys.readouterr().err
