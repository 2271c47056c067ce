"""The one progress format: durations as h:mm:ss, the time left from the rate so far, the line."""

from __future__ import annotations

import io
import math

from megatron_triroute.progress import Progress, clock, eta, rate_text


def test_clock_writes_hours_minutes_seconds_and_no_rate_as_unknown():
    assert clock(0) == "0:00:00"
    assert clock(3725.9) == "1:02:05"  # whole seconds, truncated
    assert clock(25 * 3600 + 61) == "25:01:01"  # hours are not wrapped at a day
    assert clock(-5) == "0:00:00"
    assert clock(math.inf) == "?" and clock(math.nan) == "?"


def test_eta_is_the_rest_at_the_rate_so_far():
    assert eta(25, 100, 10.0) == 30.0  # 2.5 units/s, 75 left
    assert eta(100, 100, 10.0) == 0.0
    assert eta(120, 100, 10.0) == 0.0  # past the total: nothing left, never negative
    assert eta(0, 100, 10.0) == math.inf  # no rate yet
    assert eta(5, 100, 0.0) == math.inf


def test_rate_text_keeps_the_digits_it_needs():
    assert rate_text(12345.6) == "12,346"
    assert rate_text(12.34) == "12.3"
    assert rate_text(0.01234) == "0.012"


def test_line_has_done_total_percent_rate_and_eta():
    p = Progress(100, "tokens", "evaluate", stream=io.StringIO())
    p.done = 25
    assert p.line("set a", 10.0) == "[evaluate] set a | 25/100 tokens (25%) | 2.5 tokens/s | ETA 0:00:30"
    p.done = 0
    assert p.line("starting", 0.0).endswith("| 0.000 tokens/s | ETA ?")


def test_update_prints_at_most_once_per_interval_unless_forced_or_done():
    out = io.StringIO()
    p = Progress(3, "runs", "sweep", interval=3600.0, stream=out)
    p.update(1, "first")  # the first update always prints
    p.update(1, "second")  # within the interval: silent
    p.update(0, "forced", force=True)
    p.update(1, "last")  # the last unit always prints
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["[sweep] first", "[sweep] forced", "[sweep] last"]
    assert "3/3 runs (100%)" in lines[-1] and lines[-1].endswith("ETA 0:00:00")


def test_a_measure_prints_to_one_decimal_and_an_empty_total_is_done():
    out = io.StringIO()
    p = Progress(0.3, "MB", "export", interval=0, stream=out)
    p.update(0.3, "wrote model.safetensors")
    assert " | 0.3/0.3 MB (100%) | " in out.getvalue() and out.getvalue().rstrip().endswith("ETA 0:00:00")
    assert Progress(0, "MB", stream=io.StringIO()).line("nothing", 1.0).startswith("[evaluate] nothing | 0/0 MB (100%)")
