"""The names of the aten (and triroute) ops a block of code dispatches, in order: the tests' count
of what actually ran (one kernel call where a chain stood, no sync op)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOps(TorchDispatchMode):
    """`with DispatchedOps() as ops: ...` then `ops.names`, e.g. ["mode_mix"]."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
