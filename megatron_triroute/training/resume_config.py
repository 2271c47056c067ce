"""What a resumed run may change: the checkpoint's config against the new one.

A field that may change is applied (the new run's value is used from the first resumed step) and
logged as one line per field; any other change is refused, naming every such field, both values
and the fix, before any state is loaded. The lists are explicit: a field not named here cannot
change, so a new config field is refused on resume until someone decides it is safe.
"""

from __future__ import annotations

import json
from typing import Any

from ..config import ConfigError

MAY_CHANGE: dict[str, str] = {
    "name": "logging",
    "output_dir": "output path",
    "data.path": "data path (the same prepared data set, moved)",
    "data.buckets": "evaluation sets",
    # Caveat: the training set is sized steps x global batch; when a new step count needs more
    # passes over the data, Megatron's index reshuffles the whole sample order, so the batches after
    # the resume are not those an uninterrupted run of the new length would see (docs/infrastructure.md).
    "train.steps": "schedule length",
    "optim.warmup_steps": "schedule",
    "optim.min_lr_ratio": "schedule",
    "train.log_interval": "interval",
    "train.eval_interval": "interval",
    "train.save_interval_steps": "interval",
    "train.save_interval_minutes": "interval",
    "train.keep_last": "checkpoint retention",
    "train.start_fresh": "what a start over unverifiable checkpoints does",
    "train.checkpoint_check": "how a resume verifies its checkpoint",
    "train.async_save": "how checkpoints are written (the same files)",
    "train.exit_interval": "when this run stops",
    "train.init_from": "read only when a run starts",
    "train.eval_batches": "evaluation size",
    "train.micro_batch_size": "gradient-accumulation split of the same global batch",
    "train.recompute": "activation memory (same math)",
    "train.max_nonfinite_steps": "failure policy",
    "train.peak_tflops": "logging",
    "train.collapse_entropy": "logging",
    "parallel.tensor": "parallel layout",
    "parallel.pipeline": "parallel layout",
    "parallel.expert": "parallel layout",
    # Checkpoints of the retired engines (replicated, megatron) resume on megatron_distopt: the
    # same whole-moment optimizer state, the same update (parallel/dp_engine.py: RETIRED_DP_ENGINES).
    "parallel.dp_engine": "how gradients are reduced (the same update; the optimizer state is the same)",
    "parallel.overlap_grad_reduce": "when gradients are reduced (same math)",
    "parallel.overlap_param_gather": "when updated parameters are gathered (same math)",
    "parallel.bucket_mb": "gradient bucket size (same math)",
    "triroute.router.expert_compute": "how one rank's experts compute (the same routes and math)",
    "triroute.router.local_attention": "how the local mode's attention is computed (the same attention)",
    "triroute.router.compile": "whether the routing ops are compiled (the same ops)",
    "triroute.budget.flops_target": "budget target",
    "triroute.budget.mem_target": "budget target",
}
"""Fields a resume may change, each with why it is safe."""

MAY_NOT_CHANGE: list[tuple[str, str]] = [  # (field or section prefix, what it is); first match wins
    ("triroute.model.vocab_size", "tokenizer vocabulary"),
    ("triroute.model.", "model shape"),
    ("triroute.router.bits", "KV bit widths"),
    ("triroute.router.", "router structure"),
    ("triroute.seed", "seed"),
    ("data.seed", "data seed (the batch sequence)"),
    ("triroute.losses.", "loss definition"),
    ("triroute.budget.", "budget controller (its multipliers and EMA are restored)"),
    ("optim.", "optimizer hyperparameter (restored from the checkpoint's optimizer state)"),
    ("train.global_batch_size", "global batch (the batch sequence)"),
    ("data.", "training data (the batch sequence)"),
    ("system", "system"),
]


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; tuples become lists so a JSON round trip compares equal."""
    flat: dict[str, Any] = {}
    for key, value in json.loads(json.dumps(tree)).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def what_it_is(field: str) -> str:
    for prefix, label in MAY_NOT_CHANGE:
        if field == prefix or (prefix.endswith(".") and field.startswith(prefix)):
            return label
    return "not a field a resume may change"


def check_resume_config(saved: dict, new: dict, *, source: str) -> list[str]:
    """Compare the checkpoint's config `saved` (from `source`) with the new run's `new` (both as
    `RunConfig.to_dict()` trees). Returns one line per applied change; raises ConfigError naming
    every refused change."""
    before, after = flatten(saved), flatten(new)
    applied, refused = [], []
    for field in sorted(before.keys() | after.keys()):
        if field not in before:
            applied.append(f"{field}: not in the checkpoint's config (older code), using {after[field]!r}")
            continue
        if field not in after:
            applied.append(f"{field}: in the checkpoint's config but no longer a field, dropped ({before[field]!r})")
            continue
        old, value = before[field], after[field]
        if old == value:
            continue
        if field in MAY_CHANGE:
            applied.append(f"{field}: {old!r} -> {value!r} ({MAY_CHANGE[field]})")
        else:
            refused.append((field, old, value))
    if refused:
        lines = "\n".join(f"  {f}: checkpoint {o!r}, this run {v!r} ({what_it_is(f)})" for f, o, v in refused)
        keep = " ".join(f"{f}={_override(o)}" for f, o, _ in refused)
        raise ConfigError(
            f"cannot resume from {source}: {len(refused)} field(s) differ that a resume may not change:\n{lines}\n"
            f"Fix: resume with the checkpoint's values ({keep}), or start a new run with a new output_dir. "
            f"A resume may change only: {', '.join(sorted(MAY_CHANGE))}.")
    return applied


def _override(value: Any) -> str:
    """How `apply_overrides` spells a value (lists as comma-separated items)."""
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)
