"""Saving and restoring everything a run needs to continue exactly, on any parallel layout.

Global tensors (Megatron-Core dist_checkpointing, `sharded/` in the checkpoint directory): the
model's parameters and buffers (router running statistics, budget multipliers and their EMA), each
with its global identity, and the ZeRO-1 AdamW moments, which follow their parameter's slice (see
`checkpoint/sharded.py`). A run resumed at another tensor/pipeline/expert/data-parallel size reads
its own slices of them. Per rank: LR scheduler, optimizer options, RNG states. Shared (rank 0's
meta): the resolved config, the next step, consumed samples, the AdamW step, the layout and every
rank's (tp, pp, ep, dp) coordinates.

The global batch sequence depends only on the step (see `data.py`) and the routing noise only on
global coordinates (sample index, global layer), so a run continues the same batches and noise
whatever layout it resumes on. Checkpoints written before this format are read by
`_load_per_rank` (same tensor/pipeline/expert layout, any data-parallel size).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from ..parallel.devices import collective_device
from ..checkpoint import (CheckpointError, NoVerifiedCheckpointError, capture_rng_state, load_shards, restore_rng_state,
                          save_checkpoint)
from ..checkpoint.sharded import GLOBAL_FORMAT, current_name
from ..checkpoint.store import (CheckpointInfo, CheckpointNotFoundError, checkpoint_candidates, no_verified_checkpoint,
                                split_step_dir, step_dir_name, trust_verified, verify_checkpoint)
from ..durability import resolve_dir
from .resume_config import check_resume_config

log = logging.getLogger(__name__)

STALE_KEYS = ("budget.targets",)
"""Model state keys older checkpoints hold that are no longer restored."""

# meta["checkpoint_format"] == GLOBAL_FORMAT (checkpoint/sharded.py): layout-independent; older
# checkpoints have no such key and are read by `_load_per_rank` (same tensor/pipeline/expert layout only).


def coordinates(groups) -> list[int]:
    return [groups.tp_rank, groups.pp_rank, groups.ep_rank, groups.dp_rank]


def save_run(root: str, step: int, model, optimizer, scheduler, groups, config_dict: dict, consumed: int,
             keep_last: int, calibration: dict | None = None, saves=None) -> None:
    """Collective: the model and the ZeRO-1 moments as global tensors (Megatron dist_checkpointing,
    under `sharded/`), and per rank the scheduler, optimizer options and RNG states; `step` is the
    next step to run. `calibration`: the record of the price calibration just run, if any (the meta's
    `prices` record, inference/prices.py, says whether the prices were calibrated). With `saves` (a
    `checkpoint.async_save.AsyncSaves`) returns once the state is snapshotted and leaves the heavy
    write and the commit to it; else returns committed."""
    from ..checkpoint.sharded import plan_state_save
    from ..checkpoint.store import begin_save
    from ..inference.prices import prices_record

    coords = torch.tensor(coordinates(groups), dtype=torch.long, device=collective_device())
    everyone = [torch.zeros_like(coords) for _ in range(groups.world_size)]
    dist.all_gather(everyone, coords)
    state = {
        "optimizer_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "scheduler": scheduler.state_dict(),
        "rng": capture_rng_state(),
    }
    meta = {
        "step": step, "consumed_samples": consumed, "config": config_dict,
        "checkpoint_format": GLOBAL_FORMAT, "adam_step": optimizer.adam_step(),
        "layout": {"world_size": groups.world_size, "tp": groups.tp, "pp": groups.pp, "ep": groups.ep, "dp": groups.dp},
        "coordinates": [c.cpu().tolist() for c in everyone],
        "prices": prices_record(model.budget.prices, calibration, step),
    }
    save = save_checkpoint if saves is None else begin_save
    done = save(root, step, state, meta, rank=groups.rank, world_size=groups.world_size, barrier=dist.barrier,
                keep_last=keep_last, write_extra=lambda directory: plan_state_save(directory, model, optimizer))
    if saves is not None:
        saves.schedule(done)


def find_resume_checkpoint(root: str, groups, *, full_check: bool = False) -> CheckpointInfo | None:
    """Collective: the checkpoint every rank resumes from, verified once. Rank 0's list of
    candidates (`checkpoint_candidates`) is broadcast; for each in turn every rank checks every
    file's size and the sha256 of its share of the files (with `full_check`, of all of them), and
    the ranks agree by an all-reduce. None for a fresh root; `NoVerifiedCheckpointError` (every
    rank) when checkpoints exist but none verifies. Without torch.distributed, this process checks
    everything (`latest_valid_checkpoint`)."""
    if not dist.is_initialized():
        from ..checkpoint import latest_valid_checkpoint

        return latest_valid_checkpoint(root)
    device = collective_device()
    listed = [[step, str(path)] for step, path in checkpoint_candidates(root)] if groups.rank == 0 else None
    candidates = broadcast_json(listed, device)
    problems = []
    for step, path in candidates:
        share = None if full_check else (groups.rank, groups.world_size)
        problem, manifest = verify_checkpoint(path, step, share=share)
        failed = torch.zeros(groups.world_size, device=device)
        failed[groups.rank] = float(problem is not None)
        dist.all_reduce(failed)
        if not failed.any():
            trust_verified(path)
            if problems and groups.rank == 0:
                log.warning("falling back to checkpoint %s", path)
            return CheckpointInfo(step, Path(path), manifest["world_size"])
        ranks = failed.nonzero().flatten().tolist()
        if problem is not None:
            log.warning("checkpoint %s is unusable (rank %d's check): %s", path, groups.rank, problem)
        problems.append(f"{Path(path).name}: " + (problem if problem is not None else
                                                   f"failed verification on rank(s) {ranks} (see their logs)"))
    if not problems:
        return None
    raise no_verified_checkpoint(root, problems)


def broadcast_json(value, device):
    """Rank 0's JSON-serialisable `value` on every rank (no pickle on the wire)."""
    data = torch.tensor(list(json.dumps(value).encode()) if dist.get_rank() == 0 else [], dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long, device=device)
    dist.broadcast(size, 0)
    buffer = data.to(device) if dist.get_rank() == 0 else torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, 0)
    return json.loads(bytes(buffer.cpu().tolist()).decode())


def load_run(root: str, model, optimizer, scheduler, groups, config: dict | None = None, *,
             full_check: bool = False) -> dict | None:
    """Restore the newest valid checkpoint under `root`; returns its meta, or None if none.

    With `config` (the new run's `RunConfig.to_dict()`), first compares it with the checkpoint's:
    changes a resume may make are logged (rank 0), any other is refused (see resume_config.py).
    The checkpoint is verified once, its checksums shared between the ranks (`find_resume_checkpoint`).
    """
    info = find_resume_checkpoint(root, groups, full_check=full_check)
    if info is None:
        return None
    _, headers, meta = load_shards(root, ranks=[], step=info.step)
    if meta.get("weights_only"):
        raise CheckpointError(
            f"{info.path} holds weights only (imported from {meta.get('imported_from', 'an export')}): it has no "
            "optimizer, schedule or data position to resume. Fix: start a new run from it with "
            f"train.init_from={root} and another output_dir.")
    if config is not None:
        for line in check_resume_config(meta["config"], config, source=str(info.path)):
            if groups.rank == 0:
                log.warning("resume changes %s", line)
    if meta.get("checkpoint_format") == GLOBAL_FORMAT:
        _load_global(root, info, meta, model, optimizer, scheduler, groups)
    else:
        _load_per_rank(root, info, meta, model, optimizer, scheduler, groups)
    return meta


def _load_global(root: str, info, meta: dict, model, optimizer, scheduler, groups) -> None:
    """Any layout: every rank reads its slices of the global tensors; the scheduler and optimizer
    options are the same on every old rank; RNG states come from the same old rank where it
    exists (the routing noise is keyed by global coordinates, not by these generators)."""
    from ..checkpoint.sharded import load_state
    from ..checkpoint.store import EXTRA_DIR

    layout = meta["layout"]
    source = groups.rank if groups.rank < layout["world_size"] else 0
    _, shards, _ = load_shards(root, ranks=[source], step=info.step)
    state = shards[source]
    load_state(Path(info.path) / EXTRA_DIR, model, optimizer, adam_step=meta.get("adam_step"))
    restore_learning_rate(optimizer.param_groups, state["optimizer_groups"], info.path)
    load_scheduler_state(scheduler, state["scheduler"], info.path)
    restore_rng_state(state["rng"])
    old = (layout["tp"], layout["pp"], layout["ep"], layout["dp"])
    new = (groups.tp, groups.pp, groups.ep, groups.dp)
    if old != new and groups.rank == 0:
        log.warning("resumed %s written at tensor/pipeline/expert/data-parallel %s on %s (data-parallel %d -> %d)",
                    info.path, old, new, layout["dp"], groups.dp)


def restore_learning_rate(param_groups: list[dict], saved: list[dict], source) -> None:
    """The scheduled learning rate at the checkpoint (`lr`, `initial_lr`: the same in every group).
    The other group options come from the config, which a resume may not change (`optim.*`); the
    groups themselves differ between engines (ZeRO-1: decay / no decay; the distributed optimizer
    also splits dense / expert), so they are not matched by position."""
    rates = {(g["lr"], g.get("initial_lr")) for g in saved}
    if len(rates) != 1:
        raise CheckpointError(f"{source}: its optimizer groups have different learning rates {sorted(rates)}; this "
                              "code schedules one rate for every group. Fix: resume with the code that wrote it.")
    lr, initial = rates.pop()
    for group in param_groups:
        group["lr"] = lr
        if initial is not None:
            group["initial_lr"] = initial


def load_scheduler_state(scheduler, saved: dict, source) -> None:
    """The LR scheduler's state, with its per-group lists (one entry per optimizer group, all
    equal) fitted to this run's number of groups, which another engine may make different."""
    n = len(scheduler.base_lrs)
    state = dict(saved)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        values = state.get(key)
        if isinstance(values, list) and len(values) != n:
            if any(v != values[0] for v in values):
                raise CheckpointError(f"{source}: the scheduler's {key} differ between groups ({values}); they "
                                      f"cannot be spread over this run's {n} groups")
            state[key] = [values[0]] * n
    scheduler.load_state_dict(state)


def _load_per_rank(root: str, info, meta: dict, model, optimizer, scheduler, groups) -> None:
    """Checkpoints written before the global-tensor format: per-rank model and optimizer shards."""
    layout = meta["layout"]
    if (layout["tp"], layout["pp"], layout["ep"]) != (groups.tp, groups.pp, groups.ep):
        raise RuntimeError(
            f"checkpoint {info.path} has tensor/pipeline/expert layout {(layout['tp'], layout['pp'], layout['ep'])}, "
            f"this run has {(groups.tp, groups.pp, groups.ep)}, and it predates layout-independent checkpoints. "
            "Fix: resume with the same parallel.tensor, parallel.pipeline and parallel.expert (only the "
            "data-parallel size may change); its next checkpoint then resumes on any layout.")
    mine = coordinates(groups)[:3]
    same_layout = layout["world_size"] == groups.world_size and meta["coordinates"][groups.rank] == coordinates(groups)
    # Same layout: every rank reads its own shard (its ZeRO share, its RNG). Otherwise the model
    # comes from the lowest old rank holding the same tensor/pipeline/expert shard.
    source = groups.rank if same_layout else min(r for r, c in enumerate(meta["coordinates"]) if c[:3] == mine)
    _, shards, _ = load_shards(root, ranks=[source], step=info.step)
    state = shards[source]
    # Budget targets come from the config, never the checkpoint (a resume may change them);
    # checkpoints written while they were a saved buffer still hold them.
    model_state = {current_name(k): v for k, v in state["model"].items() if not k.endswith(STALE_KEYS)}
    missing, unexpected = model.load_state_dict(model_state, strict=False)
    # Checkpoints written before the deployed-policy prices existed hold none: they load as zero.
    missing = [k for k in missing if not k.endswith(("_extra_state", "budget.prices"))]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {info.path} does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}. Fix: resume with the config the run was started with.")
    if same_layout:
        optimizer.load_state_dict([state["optimizer"]])
    else:  # ZeRO-1 ownership moved: gather every owned state from the old replicas of this shard
        same_shard = [r for r, c in enumerate(meta["coordinates"]) if c[:3] == mine]
        _, replicas, _ = load_shards(root, ranks=same_shard, step=info.step)
        optimizer.load_state_dict([replicas[r]["optimizer"] for r in same_shard])
    load_scheduler_state(scheduler, state["scheduler"], info.path)  # the engine's groups may differ from the writer's
    restore_rng_state(state["rng"])
    if layout["world_size"] != groups.world_size:
        log.warning("resumed %s written by %d ranks on %d ranks (data-parallel %d -> %d); rank %d took rank %d's shard",
                    info.path, layout["world_size"], groups.world_size, layout["dp"], groups.dp, groups.rank, source)


INIT_FROM_MUST_MATCH = ("triroute.model.", "triroute.router.")
"""Config sections a run started with `train.init_from` must share with the checkpoint: the weights
were trained for this shape and these routing decisions."""


def init_from_checkpoint(path: str, model, groups, config: dict, optimizer=None) -> dict:
    """A new run's start from another checkpoint's weights (`train.init_from`): the model's
    parameters and buffers from the newest valid checkpoint under `path` (a checkpoint root or one
    `step_*` directory), read at this run's layout whatever layout wrote it; the optimizer,
    schedule, data position and step counter are this run's own, fresh (given the `optimizer`, its
    fp32 masters of bf16 parameters take the stored values). Returns the source's meta."""
    from ..checkpoint.sharded import load_model
    from ..checkpoint.store import EXTRA_DIR
    from ..config import ConfigError
    from .resume_config import flatten

    source = Path(path)
    if (source / "config.json").is_file() and any((source / f).is_file() for f in
                                                  ("model.safetensors", "model.safetensors.index.json")):
        raise CheckpointError(f"train.init_from={path} is a Hugging Face export. Fix: convert it first with "
                              f"`python -m megatron_triroute.export --import {path} --output CKPT_DIR` and pass "
                              "train.init_from=CKPT_DIR.")
    root, step = split_step_dir(source)
    try:  # every file verified against its manifest; the newest valid step of a root
        step, _, meta = load_shards(root, ranks=[], step=step)
    except CheckpointError as error:
        nothing = isinstance(error, CheckpointNotFoundError) and not isinstance(error, NoVerifiedCheckpointError)
        what = "no checkpoint there" if nothing else "cannot be used"
        raise CheckpointError(f"train.init_from={path}: {what} ({error}). Fix: pass a run's checkpoints/ directory, "
                              "one of its step_* directories (a complete one), or an imported export.") from None
    if meta.get("checkpoint_format") != GLOBAL_FORMAT:
        raise CheckpointError(f"train.init_from={path}: written before layout-independent checkpoints. Fix: resume "
                              "that run once (its next checkpoint is layout-independent), or re-import the export.")
    saved, new = flatten(meta["config"]), flatten(config)
    differ = [f"{k}: checkpoint {saved.get(k)!r}, this run {new.get(k)!r}" for k in sorted(saved.keys() | new.keys())
              if k.startswith(INIT_FROM_MUST_MATCH) and saved.get(k) != new.get(k)]
    if differ:
        raise ConfigError(f"train.init_from={path}: the model or router config differs from the checkpoint's:\n  " +
                          "\n  ".join(differ) + "\nFix: start from a checkpoint of this shape, or set these "
                          "fields to the checkpoint's values.")
    directory = root / step_dir_name(step)
    load_model(resolve_dir(directory) / EXTRA_DIR, model, optimizer)
    if groups.rank == 0:
        log.info("initialised from %s (step %d; written at tensor/pipeline/expert/data-parallel %s): weights, "
                 "running statistics and budget multipliers; optimizer, schedule and data start fresh",
                 directory, step, tuple(meta["layout"][k] for k in ("tp", "pp", "ep", "dp")))
    return meta
