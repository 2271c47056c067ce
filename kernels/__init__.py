"""Triton kernels for the TriRoute inference engine, importable as `triroute_kernels`.

Every kernel has a pure-PyTorch reference twin in `megatron_triroute` and one dispatch point.
Triton is an optional GPU extra; on CPU the kernels run only under TRITON_INTERPRET=1.
"""

try:  # Triton is optional (GPU extra).
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAS_TRITON = False
