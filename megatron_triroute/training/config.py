"""The run configuration: the routing tree plus parallel layout, optimizer, schedule, data, output.

`RunConfig` is what a recipe returns, what `key=value` overrides edit, what is printed at
start, and what every checkpoint stores (as JSON).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from ..config import (ConfigError, TriRouteConfig, _fail, _from_dict, check_types, describe_type, field_types,
                      optional_of)
from ..parallel.dp_engine import check_dp_engine


CHECKPOINT_CHECKS = ("shared", "full")
"""`train.checkpoint_check` values (training/run_state.py: find_resume_checkpoint)."""


@dataclass
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel size; must divide n_kv_heads (and n_heads)."""
    pipeline: int = 1
    """Pipeline stages; must divide n_layers."""
    expert: int = 1
    """Expert-parallel size (DeepSpeed-MoE); must divide num_experts."""
    dp_engine: str = "megatron_distopt"
    """Data-parallel engine (parallel/dp_engine.py: DP_ENGINES): "megatron_distopt", Megatron-Core's
    DistributedDataParallel reduce-scattering gradient buckets into its distributed optimizer
    (parallel/megatron_distopt.py). Checkpoints of the retired "replicated" and "megatron" resume
    on it; see docs/parallelism.md."""
    overlap_grad_reduce: bool = True
    """Launch each bucket's reduce-scatter during the last micro-batch's backward, as soon as its
    gradients are complete (False: all after the backward)."""
    overlap_param_gather: bool = True
    """All-gather the updated parameters bucket by bucket in the next forward's pre-hooks (False:
    at the end of the optimizer step)."""
    grad_reduce_dtype: str = "fp32"
    """"bf16" halves the gradient bytes, Megatron's mixed precision: the backbone's and experts'
    matrices are bf16 parameters with bf16 gradient buckets (reduce-scattered in bf16) and bf16
    all-gathers, stepped as fp32 master shards (checkpoints store the masters); needs the bf16
    forward (train.bf16). The capacity planner's layouts (Slurm jobs of the paper scales) set it."""
    bucket_mb: float = 0.0
    """Gradient bucket size in MB of fp32 gradients (0: Megatron's default,
    max(40M, 1M x dp) elements). Smaller buckets start reducing earlier in the backward."""


@dataclass
class OptimConfig:
    """AdamW with cosine decay and linear warmup (Appendix B)."""

    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak (ours)."""
    warmup_steps: int = 2000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class TrainConfig:
    steps: int = 1000
    """Optimizer steps (recipes derive it from ~20 tokens per parameter)."""
    global_batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 4
    bf16: bool | None = None
    """None: bf16 on GPU, fp32 on CPU. The router always runs in fp32."""
    recompute: bool = False
    """Full activation recomputation of every layer (Megatron's 'full'/'uniform')."""
    log_interval: int = 10
    eval_interval: int = 200
    eval_batches: int = 8
    """Validation micro-batches per evaluation (held-out set and each tail bucket): a total the
    data-parallel ranks share, rounded up to a multiple of their number (reported at start)."""
    save_interval_steps: int = 1000
    save_interval_minutes: float = 30.0
    keep_last: int = 3
    """Checkpoints kept at or below the newest; older ones are removed once superseded, and only when
    they still verify (anything else is set aside as `step_*.set-aside-*`, never deleted)."""
    start_fresh: bool = False
    """When the run's checkpoint directory holds checkpoints none of which verifies, set them aside
    (`step_*.set-aside-*`, nothing deleted) and train from step 0 instead of refusing to start.
    A verified checkpoint is always resumed: the flag cannot throw progress away on a requeue."""
    checkpoint_check: str = "shared"
    """How a resume verifies its checkpoint: "shared" (every rank checks every file's size and the
    sha256 of its share of the files, so each byte is read once over all ranks) or "full" (every
    rank checks every sha256)."""
    async_save: bool | None = None
    """Write checkpoints in the background (Megatron-Core's asynchronous save): the training loop
    stops only to snapshot the tensors to host memory and write the small per-rank files; a forked
    process writes and checksums the data files while training continues, and the checkpoint is
    committed (manifest, `latest`) at a later step once every rank's write has finished, or before
    the next save, a stop (exit 75), exit_interval and the end of the run. None: on when CUDA is
    available (GPU clusters), off on CPU, where the writer competes with training for the cores."""
    exit_interval: int = 0
    """Checkpoint and exit (status 0) after the first step that is a multiple of this, before the
    end of the schedule (Megatron's --exit-interval); 0: off. A resume continues the same schedule."""
    init_from: str = ""
    """A checkpoint (a run's `checkpoints/` directory, one `step_*` directory of it, or an imported
    Hugging Face export) whose weights, router running statistics and budget multipliers a new run
    starts from, at any parallel layout; the optimizer, schedule and data position start fresh
    (Megatron's --finetune). Used only when the run has no checkpoint of its own: a resume ignores it."""
    max_nonfinite_steps: int = 5
    """Abort after this many consecutive non-finite steps (each is skipped)."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for the MFU report (0: report achieved TFLOP/s only)."""
    collapse_entropy: float = 0.1
    """Warn when an axis's normalised option entropy in a layer falls below this."""

    @property
    def saves_async(self) -> bool:
        import torch

        return torch.cuda.is_available() if self.async_save is None else self.async_save

    @property
    def dtype_name(self) -> str:
        import torch

        bf16 = torch.cuda.is_available() if self.bf16 is None else self.bf16
        return "bf16" if bf16 else "fp32"


@dataclass
class DataConfig:
    path: str = "data/tiny"
    """A `python -m data_prep build` output directory."""
    train_prefixes: tuple[str, ...] = ("train_text_document",)
    train_weights: tuple[float, ...] = ()
    """Blend weights of `train_prefixes` (empty: proportional to size, Megatron's default)."""
    valid_prefix: str = "valid_text_document"
    buckets: tuple[str, ...] = ("rare_entity", "code", "math", "long_context")
    seed: int = 1234


@dataclass
class RunConfig:
    name: str = "tiny"
    system: str = "triroute"
    """Which of the six systems or Table 4 variants (see `megatron_triroute.systems`)."""
    triroute: TriRouteConfig = field(default_factory=TriRouteConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    output_dir: str = "runs/tiny"

    def validate(self, world_size: int | None = None) -> "RunConfig":
        self.triroute.validate()
        m, r, p, t = self.triroute.model, self.triroute.router, self.parallel, self.train
        for name in ("tensor", "pipeline", "expert"):
            if getattr(p, name) < 1:
                _fail(f"parallel.{name}", getattr(p, name), "must be >= 1", "use 1 to disable")
        check_dp_engine(p, t.bf16)
        if t.checkpoint_check not in CHECKPOINT_CHECKS:
            _fail("train.checkpoint_check", t.checkpoint_check, f"must be one of {CHECKPOINT_CHECKS}",
                  "use shared (the default) or full")
        if m.n_kv_heads % p.tensor:
            divisors = [d for d in range(1, m.n_kv_heads + 1) if m.n_kv_heads % d == 0]
            _fail("parallel.tensor", p.tensor, f"does not divide n_kv_heads={m.n_kv_heads}",
                  f"use parallel.tensor in {divisors}")
        if m.n_layers % p.pipeline:
            _fail("parallel.pipeline", p.pipeline, f"does not divide n_layers={m.n_layers}",
                  "choose a divisor of the layer count")
        if r.expert_routing and r.num_experts % p.expert:
            _fail("parallel.expert", p.expert, f"does not divide num_experts={r.num_experts}",
                  "choose a divisor of the expert count")
        if t.global_batch_size % t.micro_batch_size:
            _fail("train.global_batch_size", t.global_batch_size,
                  f"not a multiple of micro_batch_size={t.micro_batch_size}", "adjust either")
        if world_size is not None:
            mp = p.tensor * p.pipeline
            if world_size % mp:
                _fail("parallel", (p.tensor, p.pipeline), f"tensor x pipeline does not divide world size {world_size}",
                      "change the layout or the number of processes")
            dp = world_size // mp
            if (dp * p.tensor) % p.expert:
                _fail("parallel.expert", p.expert, f"does not divide data x tensor parallel = {dp * p.tensor}",
                      "choose an expert-parallel size that divides it")
            if t.global_batch_size % (t.micro_batch_size * dp):
                _fail("train.global_batch_size", t.global_batch_size,
                      f"not divisible by micro_batch_size x data_parallel = {t.micro_batch_size} x {dp}",
                      "scale the global batch or the micro-batch")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        return _from_dict(cls, data, "run")


def apply_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `a.b.c=value` overrides in place; values parse as the field's type."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=100")
        key, raw = item.split("=", 1)
        if key == "system":
            raise ConfigError(f"override {item!r}: a system reconfigures the whole routing tree, so it is applied "
                              "with the recipe. Fix: --recipe SCALE-SYSTEM (e.g. tiny-moe), or recipes.resolve().")
        target: Any = config
        parts = key.split(".")
        for part in parts[:-1]:
            if not dataclasses.is_dataclass(target) or not hasattr(target, part):
                raise ConfigError(f"override {key!r}: no section {part!r}. Fix: check the name against the printed config.")
            target = getattr(target, part)
        leaf = parts[-1]
        fields = {f.name: f for f in dataclasses.fields(target)} if dataclasses.is_dataclass(target) else {}
        if leaf not in fields:
            raise ConfigError(f"override {key!r}: unknown field {leaf!r}. Fix: use one of {sorted(fields)}.")
        setattr(target, leaf, parse_value(raw, field_types(type(target))[leaf], key))
    check_types(config)
    return config


BOOLEANS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
"""How a boolean override may be spelled (any case); anything else is refused, never read as truthy."""
NONES = ("none", "null")
"""How an override sets an optional field (`X | None`) to None (any case)."""


def parse_value(raw: str, hint: Any, key: str, optional: bool = False) -> Any:
    """The override `key=raw` as a value of the field's declared type `hint`, or a ConfigError naming
    the field, the value and the spellings the type accepts."""
    inner = optional_of(hint)
    if inner is not None:
        return None if raw.strip().lower() in NONES else parse_value(raw, inner, key, optional=True)
    origin = typing.get_origin(hint)
    if hint is bool:
        value = BOOLEANS.get(raw.strip().lower())
        if value is None:
            raise ConfigError(f"override {key}={raw!r}: not a boolean. Fix: use true or false (or 1/0, yes/no, "
                              f"on/off, any case){', or none' if optional else ''}.")
        return value
    if origin is tuple:
        kind = typing.get_args(hint)[0]
        return tuple(parse_value(item, kind, key) for item in raw.split(",") if item)
    if origin is Literal:
        choices = typing.get_args(hint)
        if raw not in choices:
            raise ConfigError(f"override {key}={raw!r}: not one of the field's choices. "
                              f"Fix: use one of {', '.join(choices)}.")
        return raw
    try:
        return hint(raw) if hint in (int, float) else raw
    except ValueError:
        raise ConfigError(f"override {key}={raw!r}: cannot parse as {hint.__name__}. Fix: give {describe_type(hint)}, "
                          f"e.g. {key}={'3' if hint is int else '0.5'}.") from None
