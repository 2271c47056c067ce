"""Exact resume, resume on another data-parallel size, corrupted-latest fallback, rank failure, a
last-step checkpoint without calibrated prices,
TensorBoard scalars: real torchrun runs of the trainer on a tiny dataset."""

import os
import signal
import time

import pytest

from megatron_triroute.training.signals import EXIT_REQUEUE

from .conftest import launch, log_text, run_to_end, steps, wait, wait_for_steps, workers

STEPS = 12
COMMON = [f"train.steps={STEPS}", "train.save_interval_steps=4"]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("reference") / "run"
    assert run_to_end(run, tiny_data, extra=COMMON) == 0, log_text(run)[-3000:]
    return run


def test_uninterrupted_run_finishes_with_summary_and_tensorboard(reference):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recorded = steps(reference)
    assert sorted(recorded) == list(range(STEPS))
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["step"] == STEPS and summary["valid/ppl"] > 1
    events = EventAccumulator(str(reference / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/lm_loss", "train/lr", "train/temperature", "train/tokens_per_s", "valid/ppl",
                "budget/lambda_flops", "budget/lambda_mem", "budget/realised_flops", "budget/realised_mem",
                "budget/target_flops", "router/attn/fraction_skip", "router/bits/fraction_2bit",
                "router/experts/fraction_null", "router/attn/entropy/layer_0", "router/bits/entropy/layer_1"):
        assert tag in tags, tag
    losses = [e.value for e in events.Scalars("train/lm_loss")]
    assert len(losses) == STEPS and losses == pytest.approx([recorded[s]["loss"] for s in range(STEPS)], rel=1e-6)
    assert any(t.startswith("valid/") and t != "valid/ppl" for t in tags)  # tail buckets evaluated


def test_signal_then_resume_is_bit_identical(reference, tiny_data, tmp_path):
    run = tmp_path / "run"
    proc = launch(run, tiny_data, extra=COMMON)
    wait_for_steps(run, 5, proc)
    os.killpg(proc.pid, signal.SIGUSR1)
    assert wait(proc) == EXIT_REQUEUE, log_text(run)[-3000:]
    stopped_at = len(steps(run))
    assert stopped_at < STEPS
    assert run_to_end(run, tiny_data, extra=COMMON) == 0, log_text(run)[-3000:]
    assert "resumed from step" in log_text(run)
    ref, got = steps(reference), steps(run)
    assert [got[s]["loss"] for s in range(STEPS)] == [ref[s]["loss"] for s in range(STEPS)]
    assert [got[s]["lambdas"] for s in range(STEPS)] == [ref[s]["lambdas"] for s in range(STEPS)]


def test_killed_run_resumes_from_last_checkpoint_bit_identically(reference, tiny_data, tmp_path):
    import re

    from megatron_triroute.checkpoint.store import latest_valid_checkpoint

    run = tmp_path / "run"
    proc = launch(run, tiny_data, extra=COMMON)
    wait_for_steps(run, 6, proc)  # a checkpoint at step 4 exists
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before_kill = step_lines(run)
    newest = latest_valid_checkpoint(run / "checkpoints")
    assert newest is not None and newest.step >= 4 and newest.step <= len(before_kill), (newest, before_kill)
    assert before_kill == list(range(len(before_kill)))
    assert run_to_end(run, tiny_data, extra=COMMON) == 0, log_text(run)[-3000:]
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+)", log_text(run))]
    assert resumed == [newest.step], resumed
    # The second launch ran exactly the steps after its checkpoint: nothing before it again.
    assert step_lines(run) == before_kill + list(range(newest.step, STEPS))
    ref, got = steps(reference), steps(run)
    assert [got[s]["loss"] for s in range(STEPS)] == [ref[s]["loss"] for s in range(STEPS)]


def step_lines(run) -> list[int]:
    """Every step record in write order (steps() keeps only the last record per step)."""
    import json

    path = run / "steps.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def test_corrupted_latest_checkpoint_falls_back_to_previous(reference, tiny_data, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    ckpt = run / "checkpoints"
    newest = sorted(p for p in ckpt.iterdir() if p.name.startswith("step_"))[-1]
    shard = next(newest.glob("rank_*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (run / "steps.jsonl").unlink()
    (run / "summary.json").unlink()
    assert run_to_end(run, tiny_data, extra=COMMON) == 0, log_text(run)[-3000:]
    text = log_text(run)
    assert "resumed from step 8" in text  # the corrupted step-12 checkpoint was skipped
    got, ref = steps(run), steps(reference)
    assert sorted(got) == list(range(8, STEPS))
    assert [got[s]["loss"] for s in range(8, STEPS)] == [ref[s]["loss"] for s in range(8, STEPS)]


@pytest.mark.distributed
def test_resume_on_fewer_data_parallel_ranks_continues_the_same_batches(reference, tiny_data, tmp_path):
    run = tmp_path / "run"
    proc = launch(run, tiny_data, nproc=2, extra=COMMON)
    wait_for_steps(run, 5, proc)
    for pid in workers(proc):  # what srun does on preemption: every task gets the signal
        os.kill(pid, signal.SIGUSR1)
    wait(proc)
    assert f"exiting with {EXIT_REQUEUE} for requeue" in log_text(run)
    first = len(steps(run))
    assert first < STEPS
    assert run_to_end(run, tiny_data, nproc=1, extra=COMMON) == 0, log_text(run)[-3000:]
    assert "data-parallel 2 -> 1" in log_text(run)
    ref, got = steps(reference), steps(run)
    for s in range(STEPS):  # same global batches, different reduction order
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], abs=1e-5), (s, first)


@pytest.mark.distributed
def test_a_dead_rank_ends_the_job_within_60_seconds(tiny_data, tmp_path):
    run = tmp_path / "run"
    proc = launch(run, tiny_data, nproc=2, extra=["train.steps=400"])
    wait_for_steps(run, 2, proc)
    ranks = workers(proc)
    assert len(ranks) == 2, ranks
    killed = time.time()
    os.kill(ranks[1], signal.SIGKILL)
    code = wait(proc, timeout=90)
    assert code != 0
    assert time.time() - killed < 60


def test_a_checkpoint_at_the_last_step_without_prices_gets_them_saved(reference, tiny_data, tmp_path):
    # A stop signal in the last step checkpoints at train.steps before the prices are calibrated.
    # Here: the reference's mid-run step-8 checkpoint (plain argmax, prices 0) resumed with
    # train.steps=8. The run has no step to train; its calibrated prices must reach the final checkpoint.
    import json
    import shutil

    from megatron_triroute.checkpoint import latest_valid_checkpoint
    from megatron_triroute.checkpoint.sharded import full_model_state

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:08d}")
    (run / "checkpoints" / "latest").write_text("step_00000008\n")
    (run / "summary.json").unlink()
    stale = full_model_state(run / "checkpoints" / "step_00000008" / "sharded")["budget.prices"]
    assert stale.abs().max() == 0
    assert run_to_end(run, tiny_data, extra=["train.steps=8", "train.save_interval_steps=4"]) == 0, log_text(run)[-3000:]
    assert "no step to train" in log_text(run)
    calibrated = json.loads((run / "summary.json").read_text())["calibration"]["prices"]
    final = latest_valid_checkpoint(run / "checkpoints")
    assert final.step == 8
    prices = full_model_state(final.path / "sharded")["budget.prices"]
    assert prices.tolist() == calibrated and any(calibrated)
