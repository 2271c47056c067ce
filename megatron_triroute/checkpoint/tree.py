"""Splits a tree of tensors and plain values into safetensors-ready tensors plus a JSON skeleton.

A tree is nested dicts / lists / tuples whose leaves are tensors or JSON values (int, float, bool,
str, None). `flatten_tree` returns `(tensors, skeleton)`: `tensors` maps dotted paths
("optimizer.state.0.exp_avg") to tensors, and `skeleton` is the tree with every tensor replaced by
`{"__tensor__": path}`. `unflatten_tree(skeleton, tensors)` is the inverse. The skeleton goes into a
JSON file, so nothing is ever pickled.

Dict keys may be str or int (optimizer state is keyed by int). A dict whose keys are all str and do
not start with "__" is stored as a JSON object; any other dict as `{"__dict__": [[key, value], ...]}`
so int keys and keys that look like markers survive. Tuples come back as tuples; NaN and infinities
as `{"__float__": "nan"}`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

TENSOR_MARK = "__tensor__"
DICT_MARK = "__dict__"
TUPLE_MARK = "__tuple__"
FLOAT_MARK = "__float__"


def flatten_tree(tree: Any) -> tuple[dict[str, torch.Tensor], Any]:
    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[tuple[str, int]] = set()

    def encode(node: Any, path: tuple[str, ...]) -> Any:
        where = ".".join(path) or "<root>"
        if isinstance(node, torch.Tensor):
            key = ".".join(path) or "tensor"
            if key in tensors:
                raise ValueError(f"two tensors flatten to the same key {key!r}: a dict key contains '.'")
            tensors[key] = _savable(node, seen_storage)
            return {TENSOR_MARK: key}
        if isinstance(node, dict):
            for key in node:
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise TypeError(f"checkpoint tree at {where}: dict key {key!r} must be str or int")
            items = [(key, encode(value, path + (str(key),))) for key, value in node.items()]
            if all(isinstance(key, str) and not key.startswith("__") for key, _ in items):
                return dict(items)
            return {DICT_MARK: [[key, value] for key, value in items]}
        if isinstance(node, tuple):
            return {TUPLE_MARK: [encode(value, path + (str(i),)) for i, value in enumerate(node)]}
        if isinstance(node, list):
            return [encode(value, path + (str(i),)) for i, value in enumerate(node)]
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if isinstance(node, float):
            # Standard JSON has no NaN/inf; repr() gives "nan", "inf", "-inf", which float() reads back.
            return node if math.isfinite(node) else {FLOAT_MARK: repr(node)}
        raise TypeError(
            f"checkpoint tree at {where}: {type(node).__name__} is neither a tensor nor a JSON value "
            "(int, float, bool, str, None); convert it (e.g. numpy arrays with torch.from_numpy)"
        )

    return tensors, encode(tree, ())


def unflatten_tree(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    def decode(node: Any) -> Any:
        if isinstance(node, dict):
            if TENSOR_MARK in node:
                key = node[TENSOR_MARK]
                if key not in tensors:
                    raise KeyError(f"checkpoint skeleton names tensor {key!r} that the shard file lacks")
                return tensors[key]
            if DICT_MARK in node:
                return {key: decode(value) for key, value in node[DICT_MARK]}
            if TUPLE_MARK in node:
                return tuple(decode(value) for value in node[TUPLE_MARK])
            if FLOAT_MARK in node:
                return float(node[FLOAT_MARK])
            return {key: decode(value) for key, value in node.items()}
        if isinstance(node, list):
            return [decode(value) for value in node]
        return node

    return decode(skeleton)


def _savable(tensor: torch.Tensor, seen_storage: set[tuple[str, int]]) -> torch.Tensor:
    """A dense, contiguous CPU tensor that shares memory with no other saved tensor
    (safetensors refuses aliased tensors; tied weights are stored twice and come back untied)."""
    if tensor.layout != torch.strided:
        raise TypeError(f"sparse tensor ({tensor.layout}) cannot be checkpointed; call .to_dense() first")
    tensor = tensor.detach().to("cpu").contiguous()
    storage = (str(tensor.device), tensor.untyped_storage().data_ptr())
    if storage[1] != 0 and storage in seen_storage:
        tensor = tensor.clone()
    elif storage[1] != 0:
        seen_storage.add(storage)
    return tensor
