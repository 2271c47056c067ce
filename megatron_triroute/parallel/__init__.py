"""Process groups, CPU workarounds and gradient reduction: the only code that knows about Megatron-Core's
parallel state and DeepSpeed's groups. Importing this package imports neither library."""

from megatron_triroute.parallel.cpu_compat import cpu_shim
from megatron_triroute.parallel.grad_reduce import reduce_gradients
from megatron_triroute.parallel.groups import (
    GroupMismatchError,
    ParallelGroups,
    ParallelLayoutError,
    destroy_parallel,
    initialize_parallel,
    validate_layout,
)

__all__ = [
    "GroupMismatchError",
    "cpu_shim",
    "ParallelGroups",
    "ParallelLayoutError",
    "destroy_parallel",
    "initialize_parallel",
    "reduce_gradients",
    "validate_layout",
]
