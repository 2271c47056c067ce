"""The pretraining loop: build, resume, train, evaluate, checkpoint, stop cleanly.

    train(run)     the process group around the run
      setup(run)   -> TrainSession: groups, model, optimizer, gradient sync, engine, data, resume
      run_loop(s)  steps, evaluations, saves, stop signals; at the end calibrate, evaluate, save

Exit statuses: 0 finished; 75 (signals.EXIT_REQUEUE) checkpointed on SIGTERM/SIGUSR1 and wants to be
resumed; 1 an error (including too many consecutive non-finite steps).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..distributed.launch_env import init_process_group
from ..durability import write_text_atomic
from . import signals
from .config import RunConfig

if TYPE_CHECKING:  # annotations only: the heavy imports happen in setup()
    from ..checkpoint.async_save import AsyncSaves
    from ..model.gpt import TriRouteGPTModel
    from ..parallel.groups import ParallelGroups
    from .engine import MicroBatch, StepReport, TrainEngine
    from .metrics import StepLogger, TensorBoard

log = logging.getLogger("megatron_triroute.train")


class NonFiniteLossError(RuntimeError):
    pass


def build_optimizer(model, run: RunConfig, groups):
    """(optimizer, grad_sync, scheduler): the data-parallel engine's optimizer (AdamW, Appendix B)
    and gradient reduction (parallel/dp_engine.py), and the warmup + cosine schedule."""
    from ..parallel.dp_engine import build_dp_engine

    optimizer, grad_sync = build_dp_engine(model, run, groups)
    o, total = run.optim, run.train.steps
    warmup = o.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, grad_sync, torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, factor)


def train(run: RunConfig, env, tables) -> int:
    """Run (or resume) `run` on this process's rank with the tokenizer's token `tables`
    (vocabulary already padded to `run.triroute.model.vocab_size`). Returns the exit status.
    Initialises torch.distributed and destroys every process group before it returns or raises."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # Long enough for a slow first index build or a large checkpoint; a dead rank is caught by
    # the launcher (torchrun's agent, srun --kill-on-bad-exit), not by this timeout.
    init_process_group(backend, env.rank, env.world_size, timeout=timedelta(minutes=30))
    try:
        status = run_loop(setup(run, env, tables))
        dist.barrier()  # leave together: no collective of any group is in flight past this point
        return status
    finally:
        # Torch's process groups torn down here, by Python, not by C++ static destructors at exit
        # (their worker threads destroyed while running abort the process: exit 134, not 0).
        from ..parallel import destroy_parallel

        destroy_parallel()
        dist.destroy_process_group()


@dataclass
class TrainSession:
    """Everything the loop needs, built and resumed by `setup`."""

    run: RunConfig
    groups: ParallelGroups
    model: TriRouteGPTModel
    optimizer: object
    """ShardedAdamW or Megatron-Core's distributed optimizer (build_optimizer)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: TrainEngine
    """One optimizer step, one evaluation pass (training/engine.py)."""
    train_ds: object
    """The training dataset (training/data.py)."""
    valid_batches: list[MicroBatch]
    bucket_batches: dict[str, list[MicroBatch]]
    """Held-out micro-batches per data bucket (run.data.buckets)."""
    out: Path
    start: int
    """The first step to train (the resumed checkpoint's step; 0 for a fresh run)."""
    loaded_uncalibrated: bool
    """The resumed checkpoint lacks calibrated prices (then a run with no step left must save them)."""
    tb: TensorBoard
    step_log: StepLogger
    saves: AsyncSaves | None = None
    """checkpoint/async_save.AsyncSaves with train.saves_async; None saves synchronously."""

    @property
    def rank0(self) -> bool:
        return self.groups.rank == 0

    @property
    def ckpt_dir(self) -> str:
        return str(self.out / "checkpoints")

    def finish_saves(self, blocking: bool = True) -> None:
        """Commits the asynchronous saves whose writes have finished on every rank (all of them,
        waiting, when `blocking`)."""
        if self.saves is not None:
            for committed in self.saves.wait() if blocking else self.saves.poll():
                if self.rank0:
                    log.info("checkpoint at step %d committed", committed)

    def save(self, next_step: int, calibration: dict | None = None) -> None:
        from .run_state import save_run

        self.finish_saves()  # one save in flight at a time
        self.optimizer.sync_params()  # a parameter all-gather may still be pending (overlap_param_gather)
        t = self.run.train
        save_run(self.ckpt_dir, next_step, self.model, self.optimizer, self.scheduler, self.groups,
                 self.run.to_dict(), next_step * t.global_batch_size, t.keep_last, calibration, self.saves)

    def evaluate(self, step: int, prices: list[float] | None = None) -> dict[str, float]:
        """Held-out perplexity and realised cost (and each bucket's perplexity) of the noise-free
        policy priced by `prices` (None: the plain argmax); logged and written to TensorBoard."""
        loss, realised = self.engine.evaluate(self.valid_batches, prices)
        results = {"valid/ppl": math.exp(min(loss, 50.0)), "valid/realised_flops": realised[0],
                   "valid/realised_mem": realised[1]}
        for name, batches in self.bucket_batches.items():
            if batches:  # an empty bucket has nothing to score
                results[f"valid/{name}_ppl"] = math.exp(min(self.engine.evaluate(batches, prices)[0], 50.0))
        if self.rank0:
            log.info("eval step %d: %s", step, " | ".join(f"{k} {v:.2f}" for k, v in results.items()))
        self.tb.scalars(results, step)
        return results


def setup(run: RunConfig, env, tables) -> TrainSession:
    """Build the parallel groups, the model, the optimizer and the data, and resume from the run's
    newest verified checkpoint (or `train.init_from`); inside an initialised process group."""
    from megatron.core import parallel_state

    from ..inference.prices import read_prices_record
    from ..model.gpt import TriRouteGPTModel
    from ..model.spec import transformer_config
    from ..parallel import initialize_parallel
    from . import data as data_mod
    from .engine import TrainEngine
    from .metrics import StepLogger, TensorBoard
    from .run_state import init_from_checkpoint

    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    p, t = run.parallel, run.train
    groups = initialize_parallel(p.tensor, p.pipeline, p.expert)
    rank0 = groups.rank == 0
    out = Path(run.output_dir)
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        log.info("resolved config:\n%s", run.to_json())

    # --- model, optimizer, gradient reduction, step engine -----------------------------------
    torch.manual_seed(run.triroute.seed)  # identical initialisation on every data-parallel replica
    mcfg = transformer_config(run.triroute, tensor_parallel=p.tensor, pipeline_parallel=p.pipeline,
                              recompute=t.recompute)
    model = TriRouteGPTModel(mcfg, run.triroute, tables, groups=groups,
                             pre_process=parallel_state.is_pipeline_first_stage(),
                             post_process=parallel_state.is_pipeline_last_stage())
    if torch.cuda.is_available():
        model.cuda()
    optimizer, grad_sync, scheduler = build_optimizer(model, run, groups)
    if rank0:
        log.info("%s", grad_sync.describe())
    engine = TrainEngine(model, groups, optimizer, t.steps, run.optim.clip_grad, scheduler,
                         bf16=t.dtype_name == "bf16", grad_sync=grad_sync)

    # --- data ----------------------------------------------------------------------------------
    vocab = run.triroute.model.vocab_size
    train_ds, valid_ds = data_mod.build_datasets(run, tables.eod_id, vocab, barrier=dist.barrier, data_parallel=groups.dp)

    # --- resume --------------------------------------------------------------------------------
    meta = _resume(str(out / "checkpoints"), run, model, optimizer, scheduler, groups)
    if rank0:  # after the resume check: a refused config never replaces the run's config.json
        write_text_atomic(out / "config.json", run.to_json())
    if meta is None and t.init_from:
        init_from_checkpoint(t.init_from, model, groups, run.to_dict(), optimizer)
    start = 0 if meta is None else int(meta["step"])
    # A checkpoint at the last step holds the calibrated prices, unless a stop signal in the last
    # step wrote it before the calibration: then the end of this run must save them.
    loaded_uncalibrated = meta is not None and not read_prices_record(meta, model.budget.prices)["calibrated"]
    # The stored prices are the checkpoint's record of the last calibration: the checkpoints this run
    # writes before its own calibration hold none (training and its evaluations never price).
    model.budget.prices.zero_()
    if meta is not None and rank0:
        log.info("resumed from step %d (%d samples consumed)", start, meta["consumed_samples"])
        if start >= t.steps:
            log.warning("the checkpoint is at step %d and train.steps=%d: no step to train; the prices are "
                        "calibrated and the model evaluated again, nothing is saved unless the checkpoint "
                        "lacked those prices (a stop signal in the last step). Fix: raise train.steps to "
                        "continue training.", start, t.steps)

    # --- logging, evaluation batches, checkpoint writing ---------------------------------------
    tb = TensorBoard(str(out / "tensorboard") if rank0 else None)
    step_log = StepLogger(run, out, rank0, groups.world_size, start, tb)
    valid_batches = data_mod.validation_batches(valid_ds, run, groups.dp)
    bucket_batches = {name: data_mod.bucket_batches(run, name, tables.eod_id, groups.dp) for name in run.data.buckets}
    if rank0:
        log.info("evaluation: %d micro-batches of %d held-out sequences (train.eval_batches=%d, a total the %d "
                 "data-parallel ranks share, rounded up to a multiple of them)", len(valid_batches),
                 t.micro_batch_size, t.eval_batches, groups.dp)
    saves = None
    if t.saves_async:
        from ..checkpoint.async_save import AsyncSaves

        saves = AsyncSaves()
    return TrainSession(run, groups, model, optimizer, scheduler, engine, train_ds, valid_batches, bucket_batches,
                        out, start, loaded_uncalibrated, tb, step_log, saves)


def run_loop(s: TrainSession) -> int:
    """Train from `s.start` to `train.steps`: steps, periodic evaluations and saves, stop signals;
    at the normal end calibrate the prices, evaluate, save and write summary.json. Returns the
    exit status."""
    from . import data as data_mod
    from .calibrate import RealisedTail

    run, t, groups = s.run, s.run.train, s.groups
    status, report, nonfinite = 0, None, 0
    last_save = time.time()
    stop = signals.torch_all_reduce_max()
    tail = RealisedTail(t.steps)
    for step in range(s.start, t.steps):
        mbs = data_mod.micro_batches(s.train_ds, step, run, groups.dp_rank, groups.dp)
        report = s.engine.train_step(mbs, step)
        s.finish_saves(blocking=False)
        nonfinite = _count_nonfinite(nonfinite, report, t.max_nonfinite_steps, s.rank0)
        if not report.skipped:
            tail.add(step, report.realised)
        s.step_log.step(step, report, s.scheduler.get_last_lr()[0])
        if (step + 1) % t.eval_interval == 0 and step + 1 < t.steps:
            s.evaluate(step + 1)
        due = (step + 1) % t.save_interval_steps == 0 or time.time() - last_save > 60 * t.save_interval_minutes
        stopping = signals.stop_agreed(stop)
        exiting = t.exit_interval > 0 and (step + 1) % t.exit_interval == 0 and step + 1 < t.steps
        if stopping or exiting or (due and step + 1 < t.steps):
            s.save(step + 1)
            if stopping or exiting:
                s.finish_saves()
            last_save = time.time()
            s.tb.flush()
        if stopping:
            if s.rank0:
                log.warning("stop signal: checkpointed at step %d, exiting with %d for requeue",
                            step + 1, signals.EXIT_REQUEUE)
            status = signals.EXIT_REQUEUE
            break
        if exiting:
            if s.rank0:
                log.info("train.exit_interval=%d: checkpointed at step %d, exiting; resume continues the schedule",
                         t.exit_interval, step + 1)
            break
    else:
        _finish(s, report, tail)
    s.tb.close()
    return status


def _finish(s: TrainSession, report: StepReport | None, tail) -> None:
    """The normal end: calibrate the deployed prices, evaluate the priced policy, save the final
    checkpoint (with the prices) and write summary.json."""
    t = s.run.train
    calibration = _calibrate(s)
    prices = None
    if calibration is not None:
        prices = calibration["prices"]
        s.model.budget.prices.copy_(torch.tensor(prices, dtype=torch.float64))  # the checkpoint's copy
    results = s.evaluate(t.steps, prices)
    if s.start < t.steps or (s.loaded_uncalibrated and calibration is not None):
        s.save(t.steps, calibration)
        s.finish_saves()
    if s.rank0:
        _write_summary(s.out, s.run, results, report, calibration, tail)


def _resume(ckpt_dir: str, run: RunConfig, model, optimizer, scheduler, groups) -> dict | None:
    """The run's own newest verified checkpoint, restored; None for a fresh start. A directory
    whose checkpoints all fail verification is refused (every rank raises), unless
    `train.start_fresh` sets them aside and starts from step 0."""
    from ..checkpoint import NoVerifiedCheckpointError
    from ..checkpoint.store import set_aside_all
    from .run_state import load_run

    full = run.train.checkpoint_check == "full"
    try:
        return load_run(ckpt_dir, model, optimizer, scheduler, groups, config=run.to_dict(), full_check=full)
    except NoVerifiedCheckpointError as error:
        if not run.train.start_fresh:
            raise
        if groups.rank == 0:
            log.warning("train.start_fresh=true: %s; setting them aside and training from step 0", error)
            set_aside_all(ckpt_dir, "train.start_fresh=true over checkpoints none of which verifies")
        dist.barrier()
        return None


def _count_nonfinite(in_a_row: int, report, limit: int, rank0: bool) -> int:
    """Consecutive skipped (non-finite) steps after `report`; raises at `limit` of them."""
    if not report.skipped:
        return 0
    in_a_row += 1
    if rank0:
        log.warning("step %d: non-finite loss or gradient; step skipped (%d in a row)", report.step, in_a_row)
    if in_a_row >= limit:
        raise NonFiniteLossError(f"{in_a_row} consecutive non-finite steps (last {report.step}). Fix: lower optim.lr, "
                                 "check the data, or resume from an earlier checkpoint.")
    return in_a_row


def _calibrate(s: TrainSession) -> dict | None:
    """Calibrate the deployed policy's prices on the last trained batches (TriRoute with a budget
    only); None when there is nothing to calibrate."""
    from ..inference.prices import is_priced
    from . import data as data_mod
    from .calibrate import calibrate_prices, movable_resources

    run = s.run
    if not is_priced(run.triroute):
        return None
    if run.train.steps == 0:
        if s.rank0:
            log.warning("train.steps=0: no trained batch to calibrate the deployed prices on; the plain "
                        "argmax policy is evaluated")
        return None
    batches = data_mod.calibration_batches(s.train_ds, run, run.train.steps, s.groups.dp)
    return calibrate_prices(s.model.budget, lambda prices: s.engine.evaluate(batches, prices)[1],
                            movable_resources(run.triroute.router))


def _write_summary(out: Path, run: RunConfig, results: dict, report, calibration: dict | None, tail) -> None:
    """summary.json: the held-out results, the last step's realised cost against the targets, the
    price calibration and the realised-cost tail."""
    summary = {"step": run.train.steps, **results}
    if report is not None:
        summary.update({"realised_flops": report.realised[0], "realised_mem": report.realised[1],
                        "target_flops": run.triroute.budget.flops_target,
                        "target_mem": run.triroute.budget.mem_target, "lambdas": report.lambdas,
                        "final_loss": report.loss})
    if calibration is not None:
        summary["calibration"] = calibration
    summary["realised_tail"] = tail.summary()
    summary["tensorboard"] = str(out / "tensorboard")
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2))
    log.info("finished: %s", json.dumps(summary))
