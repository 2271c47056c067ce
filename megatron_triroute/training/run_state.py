"""Saving and restoring everything a run needs to continue exactly.

Per rank: model (parameters and buffers: router running statistics, budget multipliers and
their EMA), optimizer, LR scheduler, RNG states. Shared (rank 0's meta): the resolved config,
the next step, consumed samples, and every rank's (tp, pp, ep, dp) coordinates.

Resuming on a different data-parallel size (same tensor/pipeline/expert layout): parameters are
replicated over data-parallel ranks (experts over expert-data-parallel ranks), so each new rank
loads the model from the lowest old rank with the same (tp, pp, ep) coordinates; the optimizer
state is sharded by parameter (ZeRO-1), so each rank gathers the states of the parameters it now
owns from all old ranks with those coordinates. The global batch sequence does not depend on the data-parallel size (see
`data.py`), so the run continues the same sequence of batches.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..parallel.devices import collective_device
from ..checkpoint import capture_rng_state, latest_valid_checkpoint, load_shards, restore_rng_state, save_checkpoint
from .resume_config import check_resume_config

log = logging.getLogger(__name__)

STALE_KEYS = ("budget.targets",)
"""Model state keys older checkpoints hold that are no longer restored."""


def coordinates(groups) -> list[int]:
    return [groups.tp_rank, groups.pp_rank, groups.ep_rank, groups.dp_rank]


def save_run(root: str, step: int, model, optimizer, scheduler, groups, config_dict: dict, consumed: int,
             keep_last: int) -> None:
    """Collective: every rank writes its shard; `step` is the next step to run."""
    coords = torch.tensor(coordinates(groups), dtype=torch.long, device=collective_device())
    everyone = [torch.zeros_like(coords) for _ in range(groups.world_size)]
    dist.all_gather(everyone, coords)
    state = {
        "model": {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": capture_rng_state(),
    }
    meta = {
        "step": step, "consumed_samples": consumed, "config": config_dict,
        "layout": {"world_size": groups.world_size, "tp": groups.tp, "pp": groups.pp, "ep": groups.ep, "dp": groups.dp},
        "coordinates": [c.cpu().tolist() for c in everyone],
    }
    save_checkpoint(root, step, state, meta, rank=groups.rank, world_size=groups.world_size,
                    barrier=dist.barrier, keep_last=keep_last)


def load_run(root: str, model, optimizer, scheduler, groups, config: dict | None = None) -> dict | None:
    """Restore the newest valid checkpoint under `root`; returns its meta, or None if none.

    With `config` (the new run's `RunConfig.to_dict()`), first compares it with the checkpoint's:
    changes a resume may make are logged (rank 0), any other is refused (see resume_config.py).
    """
    info = latest_valid_checkpoint(root)
    if info is None:
        return None
    _, headers, meta = load_shards(root, ranks=[], step=info.step)
    if config is not None:
        for line in check_resume_config(meta["config"], config, source=str(info.path)):
            if groups.rank == 0:
                log.warning("resume changes %s", line)
    layout = meta["layout"]
    if (layout["tp"], layout["pp"], layout["ep"]) != (groups.tp, groups.pp, groups.ep):
        raise RuntimeError(
            f"checkpoint {info.path} has tensor/pipeline/expert layout {(layout['tp'], layout['pp'], layout['ep'])}, "
            f"this run has {(groups.tp, groups.pp, groups.ep)}. Fix: resume with the same parallel.tensor, "
            "parallel.pipeline and parallel.expert (only the data-parallel size may change).")
    mine = coordinates(groups)[:3]
    same_layout = layout["world_size"] == groups.world_size and meta["coordinates"][groups.rank] == coordinates(groups)
    # Same layout: every rank reads its own shard (its ZeRO share, its RNG). Otherwise the model
    # comes from the lowest old rank holding the same tensor/pipeline/expert shard.
    source = groups.rank if same_layout else min(r for r, c in enumerate(meta["coordinates"]) if c[:3] == mine)
    _, shards, _ = load_shards(root, ranks=[source], step=info.step)
    state = shards[source]
    # Budget targets come from the config, never the checkpoint (a resume may change them);
    # checkpoints written while they were a saved buffer still hold them.
    model_state = {k: v for k, v in state["model"].items() if not k.endswith(STALE_KEYS)}
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
    scheduler.load_state_dict(state["scheduler"])
    restore_rng_state(state["rng"])
    if layout["world_size"] != groups.world_size:
        log.warning("resumed %s written by %d ranks on %d ranks (data-parallel %d -> %d); rank %d took rank %d's shard",
                    info.path, layout["world_size"], groups.world_size, layout["dp"], groups.dp, groups.rank, source)
    return meta
