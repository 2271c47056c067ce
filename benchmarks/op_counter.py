"""What a step dispatches, counted from the aten ops themselves (the benchmarks' one op counter).

`StepCounter` is a `TorchDispatchMode`: every top-level aten op dispatched while it is active
(an op a kernel calls internally is not seen) is counted, and so are the host syncs among them
(`HOST_SYNC_OPS`, device-to-host copies, and `Tensor.tolist`/`numpy`, which read values without
dispatching an op). Given the model's weights it also counts the
multiply-accumulates of every matmul-class op from the shapes it was called with, split into
`weight_macs` (one operand is a weight, or a view or copy of one: projections, experts, LM head)
and `activation_macs` (no operand is: attention scores and weighted values, whatever function
computed them), plus `scaled_dot_product_attention` kernels by their shapes. Ops outside the
`aten` namespace (custom kernels) are listed in `foreign_ops`: their work is not seen by the
counter, so a figure that depends on it is incomplete while that list is not empty. Ops known to
be slow on a GPU though cheap on a CPU (`GPU_SLOW_OPS`) are counted by name. `moved_bytes` adds up
the bytes each memory-bound op reads and writes (every op but the matmuls and attention kernels, and
views): a device-independent proxy for the device time of a GPU step's elementwise, reduction, copy
and indexing kernels, which are bound by memory traffic.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_SYNC_OPS = frozenset({
    "aten._local_scalar_dense",  # .item(), bool(tensor), int(tensor), .tolist()
    "aten.nonzero", "aten.masked_select", "aten.is_nonzero", "aten.equal",
    "aten._unique2", "aten.unique_consecutive", "aten.unique_dim", "aten.repeat_interleave.Tensor",
    "aten.bincount",  # reads the input's maximum back on CUDA, minlength or not
})
"""aten ops that need a tensor's value on the host (output size or a Python scalar): on a GPU
each waits for the device, on a CPU each is where a GPU step would wait."""

GPU_SLOW_OPS = {
    "aten.segment_reduce": "CUDA's kernel for a few long segments ran 37 ms a call at 32,768 rows a segment "
                           "(an H200; the training step 5.27x Dense's: docs/gpu.md, fourth run)",
}
"""aten ops measured pathologically slow on a GPU at our shapes, though cheap on a CPU: a CPU
step that dispatches one hides a GPU regression no CPU figure shows. Counted by name."""

MASK_INDEX_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})
"""Indexing ops that sync when an index is a boolean mask (`x[mask]`, `x[mask] = v`): the mask's
`nonzero` runs inside the op, where the dispatcher does not see it. Counted as "aten.index (mask)"."""

MATMUL_OPS = frozenset({"aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.addbmm", "aten.mv",
                        "aten.addmv", "aten.dot", "aten.vdot"})
"""Matmul-class ops whose MACs are read from their operand shapes (matmul, einsum and linear
reach the dispatcher as these)."""

LINEAR_KERNELS = frozenset({"triroute.decode_linear"})
"""Custom kernels computing x w^T (x [M, K], w [N, K]): counted like the matmuls, M N K MACs, not
listed among `foreign_ops` (their whole work is in those MACs)."""

SDPA_OPS = frozenset({"aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention",
                      "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
                      "aten._scaled_dot_product_attention_math"})

COMPUTE_OPS = MATMUL_OPS | SDPA_OPS | LINEAR_KERNELS | frozenset({
    "aten._grouped_mm", "aten.convolution", "aten.convolution_backward",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward", "aten._scaled_dot_product_flash_attention_backward",
    "aten._scaled_dot_product_efficient_attention_backward", "aten._scaled_dot_product_cudnn_attention_backward",
})
"""Ops bound by arithmetic, not memory traffic: left out of `moved_bytes`."""

NO_DATA_OPS = frozenset({"aten._unsafe_view", "aten.lift_fresh", "aten.detach", "aten.alias", "aten.empty",
                         "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
                         "aten.split", "aten.split_with_sizes", "aten.unbind", "aten.chunk"})
"""Ops that move no tensor data whatever their schema says (allocations, metadata-only results)."""


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses (a broadcast dimension, stride 0, counts once;
    a tensor without strides, sparse or nested, counts 0)."""
    if t.layout != torch.strided:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, torch.Tensor))


def moved_bytes(func, args, kwargs, out) -> int:
    """Bytes a memory-bound op reads and writes: its tensor operands and its results (an in-place
    op's result is its operand, read and written); 0 for views, metadata ops and `COMPUTE_OPS`."""
    packet = str(func.overloadpacket)
    if packet in COMPUTE_OPS or packet in NO_DATA_OPS or func.is_view:
        return 0
    return sum(tensor_bytes(t) for t in _tensors((*args, *kwargs.values()))) + \
        sum(tensor_bytes(t) for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)))


DATA_MOVEMENT_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.t", "aten.transpose", "aten.permute", "aten.expand",
    "aten.clone", "aten.contiguous", "aten._to_copy", "aten.select", "aten.slice", "aten.unsqueeze", "aten.squeeze",
    "aten.as_strided", "aten.detach", "aten.alias", "aten.index", "aten.index_select", "aten.unbind", "aten.split",
    "aten.split_with_sizes", "aten.chunk", "aten.narrow", "aten.lift_fresh",
})
"""Ops whose output is a rearrangement or copy of their first input: a weight stays a weight."""


def _mm_macs(name: str, args) -> int:
    """MACs of one matmul-class op from its operand shapes."""
    if name in ("aten.addmm", "aten.baddbmm", "aten.addbmm", "aten.addmv"):
        a, b = args[1], args[2]
    else:
        a, b = args[0], args[1]
    if name in ("aten.dot", "aten.vdot"):
        return a.shape[0]
    if name in ("aten.mv", "aten.addmv"):
        return a.shape[0] * a.shape[1]
    if name in ("aten.bmm", "aten.baddbmm", "aten.addbmm"):
        return a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return a.shape[0] * a.shape[1] * b.shape[1]


def _sdpa_macs(args, kwargs) -> int:
    """q.k and the weighted V sum: 2 d per (query head, query, key) pair; the causal triangle under
    is_causal, the whole rectangle otherwise (a masked kernel computes every pair)."""
    q, k = args[0], args[1]
    *batch, Tq, d = q.shape
    Tk = k.shape[-2]
    causal = bool(kwargs.get("is_causal", False))
    pairs = Tq * (Tq + 1) // 2 if causal and Tq == Tk else Tq * Tk
    return 2 * d * pairs * math.prod(batch)


class StepCounter(TorchDispatchMode):
    """Counts every aten op dispatched and the host syncs among them (a device-to-host copy counts
    as a sync too); with `weights`, the matmul MACs split into weight and activation MACs."""

    def __init__(self, weights=()):
        super().__init__()
        self.ops = 0
        self.moved_bytes = 0
        """Bytes read and written by the memory-bound ops (`moved_bytes`)."""
        self.syncs: dict[str, int] = {}
        self.weight_macs = 0
        self.activation_macs = 0
        self.foreign_ops: dict[str, int] = {}
        self.gpu_slow_ops: dict[str, int] = {}
        """Calls of each of `GPU_SLOW_OPS`."""
        self.linear_kernels: dict[str, int] = {}
        """Calls of each of `LINEAR_KERNELS` (counted in `ops` and the MACs, not in `foreign_ops`)."""
        self._weight_storages = {t.untyped_storage().data_ptr() for t in weights}
        self._derived: dict[int, object] = {}  # id -> weakref of tensors derived from a weight this step

    HOST_READ_METHODS = ("tolist", "numpy")
    """Tensor methods that read values on the host without dispatching an aten op (on a GPU each is
    a device-to-host copy): counted as syncs while the counter is active."""

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in self.HOST_READ_METHODS}
        for name, method in self._saved.items():
            def read(t, *args, _name=name, _method=method, **kwargs):
                key = f"Tensor.{_name}"
                self.syncs[key] = self.syncs.get(key, 0) + 1
                return _method(t, *args, **kwargs)
            setattr(torch.Tensor, name, read)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    @property
    def host_syncs(self) -> int:
        return sum(self.syncs.values())

    def _is_weight(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self._derived.get(id(t))
        if ref is not None and ref() is t:
            return True
        return t.untyped_storage().data_ptr() in self._weight_storages

    def _mark(self, out) -> None:
        import weakref

        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._derived[id(t)] = weakref.ref(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        packet = str(func.overloadpacket)
        name = packet if func.overloadpacket.__name__ != "repeat_interleave" else str(func)
        if not packet.startswith("aten.") and packet not in LINEAR_KERNELS:
            self.foreign_ops[packet] = self.foreign_ops.get(packet, 0) + 1
        to_host = packet in ("aten._to_copy", "aten.copy_") and _device_to_host(func, args, kwargs)
        if packet in GPU_SLOW_OPS:
            self.gpu_slow_ops[packet] = self.gpu_slow_ops.get(packet, 0) + 1
        if name in HOST_SYNC_OPS or to_host:
            self.syncs[name] = self.syncs.get(name, 0) + 1
        elif packet in MASK_INDEX_OPS and _has_mask_index(args):
            key = "aten.index (mask)"
            self.syncs[key] = self.syncs.get(key, 0) + 1
        if packet in MATMUL_OPS or packet in LINEAR_KERNELS:
            if packet in LINEAR_KERNELS:  # x [M, K] w^T, w [N, K]
                self.linear_kernels[packet] = self.linear_kernels.get(packet, 0) + 1
                operands, macs = args[:2], args[0].shape[0] * args[1].shape[0] * args[0].shape[1]
            else:
                operands = args[1:3] if packet in ("aten.addmm", "aten.baddbmm", "aten.addbmm", "aten.addmv") else args[:2]
                macs = _mm_macs(packet, args)
            if any(self._is_weight(t) for t in operands):
                self.weight_macs += macs
            else:
                self.activation_macs += macs
        elif packet in SDPA_OPS:
            self.activation_macs += _sdpa_macs(args, kwargs)
        out = func(*args, **kwargs)
        self.moved_bytes += moved_bytes(func, args, kwargs, out)
        if self._weight_storages and packet in DATA_MOVEMENT_OPS and args and self._is_weight(args[0]):
            self._mark(out)
        return out


def _has_mask_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _device_to_host(func, args, kwargs) -> bool:
    src = args[1] if str(func.overloadpacket) == "aten.copy_" else args[0]
    dst = args[0] if str(func.overloadpacket) == "aten.copy_" else None
    dst_device = dst.device if dst is not None else kwargs.get("device", src.device)
    return src.device.type not in ("cpu", "meta") and torch.device(dst_device).type == "cpu"


def model_weights(*modules) -> list[torch.Tensor]:
    """Every parameter and buffer of `modules` (what `StepCounter(weights=...)` treats as weights)."""
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]
