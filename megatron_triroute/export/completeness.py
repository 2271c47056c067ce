"""The completeness check an export runs before writing anything.

`load_inference_checkpoint` already maps Megatron/DeepSpeed names to the engine's (every expert
by global id: a layout-independent checkpoint stores experts as global [layers, experts, ...]
tensors, so local ids cannot collide) and refuses missing, mis-shaped and unexpected tensors.
Here the mapped state is checked once more against the model the export ships, built on the meta
device from the recorded config: every tensor of every layer, the controllers, the whitening and
gradient-balance running statistics, the prices and the token tables, each present exactly once
with the shape the config implies; and no two experts of a layer identical (the signature of
expert-parallel shards gathered under local ids, last writer winning).
"""

from __future__ import annotations

import torch

from ..config import TriRouteConfig
from ..input_errors import InputError


class ExportError(InputError, ValueError):
    """The checkpoint (or export) cannot be exported (or imported); the message names what is wrong and the fix."""


def expected_tensors(config: TriRouteConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Engine name -> (shape, dtype) of every tensor the shipped `InferenceModel` holds."""
    from ..inference.model import InferenceModel

    with torch.device("meta"):
        model = InferenceModel(config)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite, without a temporary of the tensor's size: its minimum and
    maximum (NaN propagates into both). `torch.isfinite(t).all()` allocates |t| and two boolean masks,
    which for the embedding of a 50k vocabulary is a fifth of the 160m model on top of it."""
    if tensor.numel() == 0:
        return True
    lo, hi = torch.aminmax(tensor)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_complete(config: TriRouteConfig, state: dict[str, torch.Tensor]) -> None:
    """Refuses (ExportError) a state that is not exactly the shipped model's tensors."""
    expected = expected_tensors(config)
    problems = [f"missing {name}" for name in sorted(set(expected) - set(state))]
    problems += [f"unexpected {name}" for name in sorted(set(state) - set(expected))]
    problems += [f"{name} has shape {tuple(state[name].shape)}, the config implies {shape}"
                 for name, (shape, _) in sorted(expected.items()) if name in state and tuple(state[name].shape) != shape]
    problems += [f"{name} is not finite" for name in sorted(set(state) & set(expected))
                 if state[name].is_floating_point() and not finite(state[name])]
    r = config.router
    if r.expert_routing and not problems:
        for layer in range(config.model.n_layers):
            seen: dict[bytes, int] = {}
            for e in range(r.num_experts):
                key = b"".join(state[f"layers.{layer}.experts.{e}.{w}.weight"].contiguous().view(torch.uint8)
                               .numpy().tobytes()[:4096] for w in ("w1", "w2", "w3"))
                same = seen.get(key)
                if same is not None and all(torch.equal(state[f"layers.{layer}.experts.{e}.{w}.weight"],
                                                        state[f"layers.{layer}.experts.{same}.{w}.weight"])
                                            for w in ("w1", "w2", "w3")):
                    problems.append(f"layer {layer}: experts {same} and {e} are identical (experts gathered from "
                                    "expert-parallel shards under local ids overwrite each other)")
                seen.setdefault(key, e)
    if problems:
        raise ExportError(f"the checkpoint is incomplete or inconsistent ({len(problems)} problems): "
                          + "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
                          + ". Nothing was written. Fix: export a checkpoint the run wrote whole (every rank's "
                          "shard present), with the run config it was trained with.")
