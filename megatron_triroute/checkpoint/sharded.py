"""Layout-independent model checkpoints through Megatron-Core's `dist_checkpointing` (torch_dist).

Every tensor is saved with its global identity, as Megatron's layers describe themselves in
`sharded_state_dict()`: the global key, global shape and the slice this rank holds (tensor-parallel
partition dimension, layers stacked by global layer number under pipeline parallelism, the QKV
weight in Megatron's per-KV-group order so tensor-parallel slices are whole groups). Our DeepSpeed
experts describe themselves by global expert id (see `TriRouteExperts.sharded_state_dict`). Any
(TP, PP, EP, DP) layout then loads by slicing: Megatron reads, for each local tensor, the stored
chunks that overlap it.

No untrusted pickle on load: torch DCP stores its `.metadata` pickled, and every load reads it
(once) through a restricted unpickler that admits only the metadata classes of `dcp_metadata.py` (anything else
raises); the common state (`common.pt`) is loaded with `weights_only=True` stated; a data file
shorter than the metadata says is refused by name (`dcp_metadata.py`). Only tensors are saved and
requested: torch DCP would read pickled byte items with a full unpickle.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch

from .dcp_metadata import METADATA_FILE, read_metadata  # noqa: F401 - read_metadata is this module's API too
from .store import CheckpointError

GLOBAL_FORMAT = "global-tensors-v1"
"""meta["checkpoint_format"] of layout-independent checkpoints; earlier per-rank ones have no such key."""

log = logging.getLogger(__name__)

COMMON_FILE = "common.pt"
CONFIG_FILE = "metadata.json"
"""Megatron's non-tensor state and its format record (rank 0; this code stores no non-tensor state)."""


def coverage_problems(metadata, keys: list[str] | None = None) -> list[str]:
    """What is missing: for each (or each named) tensor, a key absent from the checkpoint, or
    stored chunks that do not cover its global shape exactly once."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    problems = []
    entries = metadata.state_dict_metadata
    for key in sorted(entries if keys is None else keys):
        entry = entries.get(key)
        if entry is None:
            problems.append(f"tensor {key!r} is not in the checkpoint")
            continue
        if isinstance(entry, BytesStorageMetadata):
            problems.append(f"{key!r} is a pickled object, which this code never loads")
            continue
        if not isinstance(entry, TensorStorageMetadata):
            continue
        total = math.prod(entry.size)
        stored = sum(math.prod(c.sizes) for c in entry.chunks)
        if stored != total:
            offsets = sorted(tuple(c.offsets) for c in entry.chunks)
            problems.append(f"tensor {key!r} of global shape {tuple(entry.size)} has {stored} of {total} "
                            f"elements stored (chunks at offsets {offsets})")
    return problems


def model_sharded_state_dict(model) -> dict:
    """The model's tensors only. Megatron's `_extra_state` entries (ShardedObjects: Transformer
    Engine FP8 scaling state, None with the local spec) are left out: torch DCP reads byte items
    back with a full unpickle, which a checkpoint must never need."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {k: v for k, v in model.sharded_state_dict(prefix="model.").items() if not isinstance(v, ShardedObject)}


LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Parameter dtypes a checkpoint never stores: it stores the fp32 masters instead."""

MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter state tensors (besides its step count), as checkpoints store them."""

EARLIER_NAMES = {"decoder.final_layernorm.weight": "decoder.final_layernorm.norm.weight"}
"""Model tensors renamed since checkpoints were first written (current name: earlier name). The
final norm was a wrapper that skipped the routing rows until the routing state became typed."""


_CURRENT_NAMES = {earlier: current for current, earlier in EARLIER_NAMES.items()}


def current_name(name: str) -> str:
    """A model tensor's current name, whichever name the checkpoint wrote it under."""
    return _CURRENT_NAMES.get(name, name)


_PER_EXPERT = re.compile(r"(.*)deepspeed_experts\.(\d+)\.(w[123])\.weight")


def stack_per_expert_names(state: dict) -> dict:
    """`state` with every run of per-expert tensors (`<p>deepspeed_experts.<i>.w1.weight`, i = 0..n-1,
    DeepSpeed's ``Experts`` layout) replaced by one stacked tensor `<p>w1.weight` (n, ...), the
    layout of `experts.stacked.StackedExperts`; other entries as they are."""
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for key in state:
        m = _PER_EXPERT.fullmatch(key)
        if m:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = key
    out = {k: v for k, v in state.items() if not _PER_EXPERT.fullmatch(k)}
    for (prefix, name), keys in groups.items():
        if sorted(keys) != list(range(len(keys))):
            raise ValueError(f"{prefix}deepspeed_experts: the state holds experts {sorted(keys)} of the per-expert "
                             f"layout, not 0..{len(keys) - 1}: a rank's shard is missing or the file is "
                             "truncated; load the complete checkpoint (every rank's file) or an earlier one")
        out[f"{prefix}{name}.weight"] = torch.stack([state[keys[i]] for i in range(len(keys))])
    return out


def _read_earlier_names(sharded: dict, metadata) -> dict:
    """`sharded` with each renamed tensor asked for under its earlier name where the checkpoint has
    only that one."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    stored = metadata.state_dict_metadata
    out = dict(sharded)
    for key, value in sharded.items():
        earlier = EARLIER_NAMES.get(key[len("model."):]) if isinstance(value, ShardedTensor) else None
        if earlier and value.key not in stored and f"model.{earlier}" in stored:
            out[key] = replace(value, key=f"model.{earlier}")
    return out


def optimizer_sharded_state_dict(model_sharded: dict, optimizer, *, empty: bool = False) -> dict:
    """AdamW moments as global tensors: each owned parameter's whole moments follow that
    parameter's slice (same global shape and offsets, key `optimizer.<moment>.<param key>`). Its
    owner is the only data-parallel replica that writes them, so it is the main replica (the
    data-parallel component of the replica id is 0). `empty=True` gives load targets.

    `optimizer` is the engine's (`parallel/megatron_distopt.MegatronDistributedAdamW`): it owns
    parameters as `parallel/ownership.owned_parameters` assigns them and gives whole moments
    (`owned_moments`, collective), so a checkpoint loads at any layout."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    # A factory (e.g. the SwiGLU fc1 weight, stored as its gate and up halves so any tensor-parallel
    # size can slice each) describes its moments too: the same build and merge over the moment.
    described = (ShardedTensor, ShardedTensorFactory)
    by_param = {id(v.data): v for v in nested_values(model_sharded) if isinstance(v, described)}
    moments = {} if empty else optimizer.owned_moments()
    out = {}
    for name, param in optimizer.owned_named_parameters():
        sh = by_param.get(id(param))
        if sh is None:
            raise CheckpointError(f"parameter {name} has no sharded description in the model")
        replica = tuple(sh.replica_id)[:-1] + (0,) if isinstance(sh.replica_id, tuple) else 0
        for moment in MOMENTS:  # fp32 whatever the parameter's dtype
            data = torch.empty(param.shape, dtype=torch.float32, device=param.device) if empty else moments[name][moment]
            out[f"optimizer.{moment}.{name}"] = _describing(sh, data, key=f"optimizer.{moment}.{sh.key}",
                                                            replica_id=replica)
    return out


def _described_with(model_sharded: dict, values: dict[int, torch.Tensor]) -> dict:
    """The entries of `model_sharded` describing a parameter with a value in `values` (by the
    parameter's id), each describing that value instead (same key, shape and slice)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return {k: _describing(v, values[id(v.data)]) for k, v in model_sharded.items()
            if isinstance(v, (ShardedTensor, ShardedTensorFactory)) and id(v.data) in values}


def _describing(described, data: torch.Tensor, **changes):
    """A copy of a ShardedTensor (or factory) describing `data` instead (its dtype too)."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(described, ShardedTensor):
        changes["dtype"] = data.dtype
    return replace(described, data=data, **changes)


def save_state(directory: str | Path, model, optimizer) -> None:
    """Collective: the model's and the optimizer moments' global tensors, each stored once. The
    model is stored in fp32: a bf16 parameter as the optimizer's fp32 master of it."""
    write = plan_state_save(directory, model, optimizer)
    write.run()
    torch.distributed.barrier()
    write.finalize()


def plan_state_save(directory: str | Path, model, optimizer):
    """Collective: what `save_state` writes, as a `store.ExtraWrite` for `save_checkpoint`'s
    `write_extra`. Returns once the tensors are snapshotted: Megatron plans the save with every
    rank, rank 0 writes `common.pt`, and the tensors are copied to host memory (from a GPU; on the
    CPU the background process forked later holds the snapshot). `run()` writes this rank's data
    files (`__<rank>_<i>.distcp`, torch DCP's names) and may run in that forked process;
    `finalize()` (collective, after every rank's `run`) writes `.metadata` and `metadata.json` on
    rank 0. Each returns the paths it wrote on this rank."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from .store import ExtraWrite

    model_sharded = model_sharded_state_dict(model)
    sharded = dict(model_sharded)
    if optimizer is not None:
        if optimizer.has_moments():
            sharded.update(optimizer_sharded_state_dict(model_sharded, optimizer))
        sharded.update(_described_with(model_sharded, optimizer.master_parameters()))
    low = sorted(v.key for v in nested_values(sharded) if getattr(getattr(v, "data", None), "dtype", None) in LOW_PRECISION)
    if low:
        raise CheckpointError(f"{low[:3]} would be stored in low precision; checkpoints store fp32 (an optimizer's "
                              "masters for bf16 parameters): pass the optimizer that holds them")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    request = dist_checkpointing.save(sharded, str(directory), sharded_strategy=("torch_dist", 1),
                                      validate_access_integrity=True, async_sharded_save=True)
    rank0 = torch.distributed.get_rank() == 0
    args = list(request.async_fn_args)
    if request.preload_fn is not None:
        args[1] = request.preload_fn()  # [(path, name, data)] per file, on the host (Megatron's D2H copy)
    common = [directory / COMMON_FILE] if rank0 else []

    def run() -> list[Path]:
        if request.async_fn is None:  # this rank holds no main replica of anything
            return common
        request.async_fn(*args, **request.async_fn_kwargs)
        return common + [Path(bucket[0]) for bucket in args[1]]

    def finalize() -> list[Path]:
        for fn in request.finalize_fns:  # gathers every rank's write results; rank 0 writes the metadata
            fn()
        return [directory / METADATA_FILE, directory / CONFIG_FILE] if rank0 else []

    return ExtraWrite(run, finalize)


def load_state(directory: str | Path, model, optimizer=None, *, adam_step: int | None = None) -> None:
    """Collective: fills this rank's slices of the model (and, with `optimizer` and the saved AdamW
    `adam_step`, its owned moments) from a checkpoint written at any layout. Refuses, naming them,
    tensors the checkpoint lacks or covers only partly. A bf16 parameter gets the stored fp32
    value's rounding, and the optimizer's master of it (if given) the fp32 value itself."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from .dcp_metadata import AllowListedReader, reading
    from .safe_load import AllowListedTorchDistLoad, WeightsOnlyCommonLoad

    reader = AllowListedReader(directory)  # the one read of the metadata: allow-listed, data files checked
    metadata = reader.read_metadata()
    model_sharded = model_sharded_state_dict(model)
    sharded = dict(model_sharded)
    with_optimizer = optimizer is not None and adam_step is not None
    if with_optimizer:
        sharded.update(optimizer_sharded_state_dict(model_sharded, optimizer, empty=True))
    low = {id(p): p for p in model.parameters() if p.dtype in LOW_PRECISION}  # read as the stored fp32
    fp32 = _described_with(model_sharded, {k: torch.empty(p.shape, dtype=torch.float32, device=p.device)
                                           for k, p in low.items()})
    sharded.update(fp32)
    sharded = _read_earlier_names(sharded, metadata)
    wanted = sorted({v.key for v in nested_values(_built(sharded)) if isinstance(v, ShardedTensor)})
    problems = coverage_problems(metadata, wanted)
    if problems:
        raise CheckpointError(f"{directory} cannot be loaded into this model: " + "; ".join(problems[:10]) +
                              (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "") +
                              ". Fix: resume from a complete checkpoint written with this model's config.")
    with reading(directory):
        loaded = dist_checkpointing.load(sharded, str(reader.path), sharded_strategy=AllowListedTorchDistLoad(reader),
                                         common_strategy=WeightsOnlyCommonLoad())
    state = {k[len("model."):]: v for k, v in loaded.items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"{directory}: model keys missing {missing[:5]}, unexpected {unexpected[:5]}")
    if optimizer is not None and fp32:
        optimizer.load_master_parameters({id(model_sharded[k].data): loaded[k] for k in fp32})
    if with_optimizer:
        optimizer.load_owned_moments({name: {m: loaded[f"optimizer.{m}.{name}"] for m in MOMENTS}
                                      for name, _ in optimizer.owned_named_parameters()}, adam_step)


def _built(sharded: dict) -> dict:
    """`sharded` with every factory replaced by the ShardedTensors it builds (the stored keys)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    def build(v):
        return v.build() if isinstance(v, ShardedTensorFactory) else v

    return dict_list_map_inplace(build, dict(sharded))


def save_model(directory: str | Path, model) -> None:
    save_state(directory, model, None)


def load_model(directory: str | Path, model, optimizer=None) -> None:
    """The model only (and, given the optimizer, its fp32 masters of bf16 parameters)."""
    load_state(directory, model, optimizer)


_PER_LAYER = re.compile(r"decoder\.layers\.\d+\.")


def stored_tensors(directory: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's global tensors whose key starts with `prefix` ("model.", or "optimizer." for
    the whole AdamW moments whichever optimizer and layout wrote them), read whole in one process
    without torch.distributed, keyed without the prefix: layers stacked, experts by global id, as
    stored. Refuses an incomplete checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp_metadata import AllowListedReader, reading

    reader = AllowListedReader(directory)  # the one read of the metadata: allow-listed, data files checked
    metadata = reader.read_metadata()
    problems = coverage_problems(metadata)
    if problems:
        raise CheckpointError(f"{directory} is incomplete: " + "; ".join(problems[:10]))
    stored = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
              if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    with reading(directory):
        dcp.load(stored, storage_reader=reader, no_dist=True)
    return {k[len(prefix):]: v for k, v in stored.items()}


def full_model_state(directory: str | Path, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """The whole model in one process, without torch.distributed, under the names a
    tensor/pipeline/expert 1/1/1 model's `state_dict()` uses (`decoder.layers.<l>.…`, a layer's
    experts stacked: `…moe.experts.w1.weight` [experts, out, in]): what exporters and one-process
    readers need, whatever layout wrote the checkpoint. `copy=False` returns the per-layer tensors
    as views into the stacked global tensors: one copy of the model in memory instead of two."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in stored_tensors(directory, "model.").items():
        name = current_name(key)
        if _PER_LAYER.match(name):  # already one layer's (layer-group controllers, see model/gpt.py)
            out[name] = tensor
        elif name.startswith("decoder.layers."):  # [layers, ...]
            rest = name[len("decoder.layers."):]
            for layer in range(tensor.shape[0]):
                out[f"decoder.layers.{layer}.{rest}"] = tensor[layer].clone() if copy else tensor[layer]
        else:
            out[name] = tensor
    return out
