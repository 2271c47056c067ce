"""Exact resume, resume on another data-parallel size, corrupted-latest fallback, rank failure, a
last-step checkpoint without calibrated prices,
TensorBoard scalars: real torchrun runs of the trainer on a tiny dataset."""

import os
import signal
import time

import pytest

from megatron_triroute.training.signals import EXIT_REQUEUE

from .conftest import (assert_moments_close, launch, log_text, moments, run_to_end, steps, wait, wait_for_steps,
                       workers)

STEPS = 12
COMMON = [f"train.steps={STEPS}", "train.save_interval_steps=4"]
MOMENT_TOL = 1e-5  # measured 0 (DP2 and one process sum the same two micro-batch gradients)


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
    # The interrupted run saves asynchronously (train.async_save): the step-4 save commits at a
    # later step, the stop's save before the exit.
    run = tmp_path / "run"
    proc = launch(run, tiny_data, extra=COMMON + ["train.async_save=true"])
    wait_for_steps(run, 5, proc)
    os.killpg(proc.pid, signal.SIGUSR1)
    assert wait(proc) == EXIT_REQUEUE, log_text(run)[-3000:]
    stopped_at = len(steps(run))
    assert stopped_at < STEPS
    assert "checkpoint at step 4 committed" in log_text(run)
    assert f"checkpoint at step {stopped_at} committed" in log_text(run)
    assert run_to_end(run, tiny_data, extra=COMMON) == 0, log_text(run)[-3000:]
    assert "resumed from step" in log_text(run)
    ref, got = steps(reference), steps(run)
    assert [got[s]["loss"] for s in range(STEPS)] == [ref[s]["loss"] for s in range(STEPS)]
    assert [got[s]["lambdas"] for s in range(STEPS)] == [ref[s]["lambdas"] for s in range(STEPS)]
    assert_moments_close(moments(run, STEPS), moments(reference, STEPS), rel=0.0)  # AdamW's state too


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
    assert_moments_close(moments(run, STEPS), moments(reference, STEPS), rel=0.0)


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
    assert_moments_close(moments(run, STEPS), moments(reference, STEPS), rel=0.0)


def test_every_checkpoint_corrupt_is_refused_and_start_fresh_keeps_them(reference, tiny_data, tmp_path):
    """A run whose checkpoints all fail verification must not start again at step 0 and prune
    them: it exits 2 naming each, nothing is touched; train.start_fresh=true sets them aside."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    ckpt = run / "checkpoints"
    saved = sorted(p for p in ckpt.iterdir() if p.name.startswith("step_"))
    assert len(saved) >= 2
    for directory in saved:
        shard = next(directory.glob("rank_*.safetensors"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    listing = sorted((str(p.relative_to(ckpt)), p.stat().st_size) for p in ckpt.rglob("*"))
    assert run_to_end(run, tiny_data, extra=COMMON) == 2
    text = log_text(run)
    assert "no valid checkpoint under" in text and "train.start_fresh=true" in text, text[-3000:]
    for directory in saved:
        assert f"{directory.name}: rank_00000.safetensors sha256" in text
    assert sorted((str(p.relative_to(ckpt)), p.stat().st_size) for p in ckpt.rglob("*")) == listing

    assert run_to_end(run, tiny_data, extra=["train.steps=1", "train.start_fresh=true"]) == 0, log_text(run)[-3000:]
    aside = sorted(p.name.split(".")[0] for p in ckpt.iterdir() if ".set-aside-" in p.name)
    assert aside == [d.name for d in saved]  # every byte kept, under names no resume reads
    assert [p.name for p in ckpt.iterdir() if p.name.startswith("step_") and "." not in p.name] == ["step_00000001"]


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
    # AdamW's moments: the DP2 run's ZeRO-1 shards, gathered whole at save, read back by one process
    worst = assert_moments_close(moments(run, STEPS), moments(reference, STEPS), rel=MOMENT_TOL)
    print(f"moments after DP2 -> DP1: worst error {worst:.3g} of a tensor's largest magnitude")


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
