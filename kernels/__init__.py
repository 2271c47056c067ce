"""Kernels of the TriRoute inference engine, importable as `triroute_kernels`.

Two kernels over the paged, precision-segregated KV pools (`pool.PagePool`): quantise-and-pack
K/V into page slots, and decode attention over one pool returning (out, lse) for a log-sum-exp
merge across pools. `quant` is the cache's number format: the supported widths (`SUPPORTED_BITS`)
and the group quantisation and packing every writer uses. Each kernel has a vectorised
pure-PyTorch twin (`torch_ops`, the CPU fast path) and a Triton kernel (`triton_ops`, CUDA, or
CPU under TRITON_INTERPRET=1); `dispatch` is the one point that chooses. Triton is an optional
GPU extra. `paged_ops` holds the decode step's one-call ops over all pools (attention with one
online softmax, the mixed-width cache write and a decode step's append, the routed experts, the small-batch linear and RMS norm): C++ CPU kernels (`cpu_ops`,
built once per machine) with PyTorch twins as the fallback. Training's kernels are the routing
noise's counter hash and its per-token chain words (`torch.ops.triroute.counter_uniform` and
`chain_words` in C++, `triton_noise` on a GPU), whose definition is the tensor chain of
`megatron_triroute.routing.noise`, and C++ CPU ops defined by tensor ops of
`megatron_triroute.routing`: the relaxed K/V write's values (`quantized_values`; on a GPU
`triton_quant`), the routing axes' softmax (`few_softmax`) and the controller's RMSNorms with their
backward (`rms_norm_rstd`, `rms_norm_backward`; a GPU runs PyTorch's fused kernels). The package
imports only torch (and triton): nothing of `megatron_triroute`.
"""

from .cpu_ops import cpu_ops_available, cpu_ops_error, takes_cpu_kernel
from .dispatch import choose_backend, decode_attention_pool, has_triton, quantize_pack_into
from .paged_ops import PoolLists, cache_append, cache_write, decode_linear, few_rows, paged_attention, rms_norm, routed_experts
from .pool import PagePool, allocate_kv_pools, allocate_pool
from .quant import SUPPORTED_BITS
from .torch_ops import (
    decode_attention_pool_torch,
    dequantize_slots,
    merge_partials,
    quantize_pack_into_torch,
)

HAS_TRITON = has_triton()

__all__ = [
    "HAS_TRITON",
    "SUPPORTED_BITS",
    "PagePool",
    "PoolLists",
    "allocate_kv_pools",
    "allocate_pool",
    "cache_append",
    "cache_write",
    "cpu_ops_available",
    "cpu_ops_error",
    "choose_backend",
    "decode_attention_pool",
    "decode_linear",
    "decode_attention_pool_torch",
    "few_rows",
    "dequantize_slots",
    "merge_partials",
    "paged_attention",
    "quantize_pack_into",
    "quantize_pack_into_torch",
    "rms_norm",
    "routed_experts",
    "takes_cpu_kernel",
]
