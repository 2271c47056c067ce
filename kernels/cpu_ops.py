"""The C++ CPU kernels (`csrc/decode_ops.cpp`, `csrc/layer_ops.cpp`, `csrc/noise_ops.cpp`,
`csrc/quant_ops.cpp`, `csrc/softmax_ops.cpp`, `csrc/mix_ops.cpp`, `csrc/whiten_ops.cpp`,
`csrc/route_ops.cpp`; each file's header names its ops): built once per machine, registered as
`torch.ops.triroute.{paged_attention, cache_write, cache_append, routed_experts, decode_linear}` and
`{controller_logits, rms_norm, decode_qkv, decode_decisions, decode_layer, decode_layers}` (a decode step's),
`torch.ops.triroute.{counter_uniform, chain_words}` (the routing noise's hash and its per-token words,
training),
`torch.ops.triroute.quantized_values` (the relaxed K/V write's values, training),
`torch.ops.triroute.{rms_norm_rstd, rms_norm_backward}` (the controller's RMSNorms, training),
`torch.ops.triroute.{whiten_heads, whiten_heads_backward, whitening_commit}` (the controller's whitened
heads and the step's commit of their statistics, training), `torch.ops.triroute.{sort_routes,
null_swap_margin, null_swap_margin_backward}` (the experts' routes sorted by expert and the
straight-through count of a token's real experts, training) and
`torch.ops.triroute.few_softmax` (the routing axes' softmax over their few options).

`cpu_ops_available()` builds on first use (g++ and ninja; a few tens of seconds, then cached in
torch's extension directory) and returns False, keeping the reason in `cpu_ops_error()`, when the
compiler is missing or the build fails: callers then use the PyTorch twins (`paged_ops`), never
crash. `-march=native` is tried first (`NATIVE_CFLAGS`); TRIROUTE_CPU_OPS_PORTABLE=1 builds
without it, TRIROUTE_NO_CPU_OPS=1 turns the kernels off. Each op has a fake (shape-only)
implementation so torch.compile can trace it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "decode_ops.cpp"
NOISE_SOURCE = "noise_ops.cpp"
QUANT_SOURCE = "quant_ops.cpp"
LAYER_SOURCE = "layer_ops.cpp"
SOFTMAX_SOURCE = "softmax_ops.cpp"
MIX_SOURCE = "mix_ops.cpp"
WHITEN_SOURCE = "whiten_ops.cpp"
ROUTE_SOURCE = "route_ops.cpp"
"""Built into the same library, from SOURCE's folder."""
HEADER = "decode_ops.h"
"""What decode_ops.cpp defines for the other sources; part of the build folder's key."""
EXTENSION_NAME = "triroute_decode_ops"
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
"""-ffp-contract=off: no multiply-add is fused unless the source names one (the vector dequantisation
does, where code * scale is exact and so rounds as `quant.dequantize_groups`' two operations); the
scale is a true float32 division, as `quant.quantize_grouped`.
-fopenmp: `at::parallel_for` is a header template whose OpenMP pragma compiles into this library;
without the flag every kernel runs on one thread whatever `torch.set_num_threads` says."""
LDFLAGS = ["-fopenmp"]
"""The OpenMP runtime, libgomp.so.1: the one torch itself loads (same soname), so one thread pool."""

NATIVE_CFLAGS = ["-march=native"]
"""Tried first: hardware float16 conversion and wider vectors (1.3-1.5x faster attention on an
AVX-512 machine, `benchmarks/bench_cpu_ops.py --portable`); the build folder's key holds this CPU's
model and flags, so a shared home directory never loads another CPU's build. Without it (a
compiler that rejects it) the portable flags are built instead."""

_state: dict = {}


def _cpu_signature() -> str:
    """The CPU's model and feature flags (Linux), what -march=native compiles for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "|".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def build_directory(flags: list[str]) -> Path:
    """Where the library is built: torch's extension root, one folder per (source, flags, torch,
    Python, machine), so a changed source or toolchain builds afresh and nothing stale is loaded."""
    key = hashlib.sha256(b"".join(path.read_bytes() for path in _build_inputs()))
    key.update(repr((flags, torch.__version__, sys.version, platform.machine(), _cpu_signature())).encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"{EXTENSION_NAME}_{key.hexdigest()[:16]}"


def _sources() -> list[Path]:
    return [SOURCE, SOURCE.parent / NOISE_SOURCE, SOURCE.parent / QUANT_SOURCE, SOURCE.parent / LAYER_SOURCE,
            SOURCE.parent / SOFTMAX_SOURCE,
            SOURCE.parent / MIX_SOURCE, SOURCE.parent / WHITEN_SOURCE, SOURCE.parent / ROUTE_SOURCE]


def _build_inputs() -> list[Path]:
    """Every file the library is built from: the sources and the header they include."""
    return [*_sources(), SOURCE.parent / HEADER]


def _build() -> None:
    if os.environ.get("TRIROUTE_NO_CPU_OPS"):
        raise RuntimeError("TRIROUTE_NO_CPU_OPS is set. Fix: unset it to build the C++ kernels")
    if not hasattr(torch.ops.triroute, "paged_attention"):
        missing = [path.name for path in _build_inputs() if not path.is_file()]
        if missing:  # e.g. an exported model's code, which ships the Python modules only
            raise RuntimeError(f"the C++ source {', '.join(missing)} is not beside this module ({SOURCE.parent}). Fix: "
                               "serve from an installed megatron-triroute to use the C++ kernels")
        native = not os.environ.get("TRIROUTE_CPU_OPS_PORTABLE")
        try:
            try:
                _load(CFLAGS + NATIVE_CFLAGS if native else CFLAGS)
            except Exception:
                if not native:
                    raise
                _load(CFLAGS)
        except Exception as e:
            raise RuntimeError(f"{type(e).__name__}: {e}. Fix: install g++ and ninja (launchers/install.sh "
                               "does)") from e
    _register_fakes()


def _load(flags: list[str]) -> None:
    from torch.utils.cpp_extension import load

    where = build_directory(flags)
    if not (where / f"{EXTENSION_NAME}.so").exists():
        print("building the CPU decode kernels (once per machine)", file=sys.stderr)
    where.mkdir(parents=True, exist_ok=True)
    load(
        name=EXTENSION_NAME,
        sources=[str(path) for path in _sources()],
        extra_cflags=flags,
        extra_ldflags=LDFLAGS,
        build_directory=str(where),
        is_python_module=False,
        verbose=False,
    )


def cpu_ops_available() -> bool:
    """Whether torch.ops.triroute.* have CPU kernels here (builds them on the first call)."""
    if "ok" not in _state:
        try:
            _build()
            _state["ok"], _state["error"] = True, None
        except Exception as e:  # a missing compiler, a failed build: the twins serve instead
            _state["ok"], _state["error"] = False, f"{type(e).__name__}: {e}"
    return _state["ok"]


def takes_cpu_kernel(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether `x` goes to a C++ kernel: a CPU tensor of one of `dtypes` (the kernel's), the kernels
    built here, and not being traced by torch.compile (which runs the tensor ops the kernels are
    defined by)."""
    return x.device.type == "cpu" and x.dtype in dtypes and not torch.compiler.is_compiling() \
        and cpu_ops_available()


def cpu_ops_error() -> str | None:
    """Why the C++ kernels are unavailable (None when they are, or before the first check)."""
    return _state.get("error")


def _register_fakes() -> None:
    if _state.get("fakes"):
        return

    @torch.library.register_fake("triroute::paged_attention")
    def _(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, token_pos, bits, group_size, page_tables, request, lo, hi, sm_scale, counters):
        return q.new_empty(q.shape)

    @torch.library.register_fake("triroute::cache_write")
    def _(k, v, option, slots, positions, k_data, k_scale, k_zero, v_data, v_scale, v_zero, token_pos, bits, group_size):
        return None

    @torch.library.register_fake("triroute::cache_append")
    def _(k, v, option, rows, positions, counts, tables, page_size, k_data, k_scale, k_zero, v_data, v_scale, v_zero,
          token_pos, bits, group_size):
        return None

    @torch.library.register_fake("triroute::routed_experts")
    def _(x, index, weight, w1, w3, w2):
        return x.new_empty(x.shape)

    @torch.library.register_fake("triroute::decode_linear")
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("triroute::counter_uniform")
    def _(prefix, sample_words, position_words, counters):
        shape = (prefix.shape[0], sample_words.shape[0], position_words.shape[1], counters.shape[0])
        return prefix.new_empty(shape, dtype=torch.float64)

    @torch.library.register_fake("triroute::chain_words")
    def _(keys, field):
        return torch.empty_like(keys)

    @torch.library.register_fake("triroute::quantized_values")
    def _(x, bits, group_size):
        return x.new_empty(x.shape[0], x.shape[1], len(bits), x.shape[2] * x.shape[3])

    @torch.library.register_fake("triroute::relaxed_write")
    def _(values, weights, shape):
        return values.new_empty(shape)

    @torch.library.register_fake("triroute::relaxed_write_backward")
    def _(values, grad):
        return values.new_empty(values.shape[:3])

    @torch.library.register_fake("triroute::few_softmax")
    def _(z):
        return torch.empty_like(z)

    @torch.library.register_fake("triroute::mode_mix")
    def _(modes, attn, columns):
        B, T, H, d = attn[0].shape
        return attn[0].new_empty(T, B, H, d).transpose(0, 1)

    @torch.library.register_fake("triroute::mode_mix_backward")
    def _(grad, modes, attn, columns):
        return modes.new_empty(modes.shape), [torch.empty_like(a) for a in attn]

    @torch.library.register_fake("triroute::combine_routes")
    def _(y, inverse, index, weight=None):
        return y.new_empty(index.shape[0], y.shape[1])

    @torch.library.register_fake("triroute::combine_routes_backward")
    def _(grad, y, order, inverse, index, weight):
        return torch.empty_like(y), torch.empty_like(weight)

    @torch.library.register_fake("triroute::st_gumbel")
    def _(z, noise, tau):
        return torch.empty_like(z), torch.empty_like(z), torch.empty_like(z)

    @torch.library.register_fake("triroute::st_gumbel_backward")
    def _(grad_y, grad_y_cost, y_soft, tau):
        return torch.empty_like(y_soft), torch.empty_like(y_soft)

    @torch.library.register_fake("triroute::top_k_gates")
    def _(probs, k):
        shape = (*probs.shape[:-1], k)
        return (probs.new_empty(shape, dtype=torch.long), probs.new_empty(shape),
                probs.new_empty((*probs.shape[:-1], 1)))

    @torch.library.register_fake("triroute::top_k_gates_backward")
    def _(grad, option, probs, total):
        return torch.empty_like(probs)

    @torch.library.register_fake("triroute::controller_logits")
    def _(x, side, g_in, eps_in, w1, b1, w2, b2, g_trunk, eps_trunk, wh, bh):
        return x.new_empty(x.shape[0], wh.shape[0])

    @torch.library.register_fake("triroute::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("triroute::rms_norm_rstd")
    def _(x, weight, eps):
        return torch.empty_like(x), x.new_empty(x.shape[0], 1)

    @torch.library.register_fake("triroute::sort_routes")
    def _(index, num_experts):
        n = index.numel()
        return (index.new_empty(n), index.new_empty(n), index.new_empty(num_experts, dtype=torch.int32),
                index.new_empty(n))

    @torch.library.register_fake("triroute::null_swap_margin")
    def _(logits, index):
        lead = index.shape[:-1]
        return logits.new_empty(lead, dtype=torch.float64), logits.new_empty(lead, dtype=torch.float64), \
            index.new_empty(*lead, 1)

    @torch.library.register_fake("triroute::null_swap_margin_backward")
    def _(grad, slope, weakest, options, dtype):
        return slope.new_empty(*slope.shape, options, dtype=dtype)

    @torch.library.register_fake("triroute::whitening_commit")
    def _(reduced, mean, var, steps, acc, momentum):
        return None

    @torch.library.register_fake("triroute::whiten_heads")
    def _(u, mean, var, gain, bias, acc, eps):
        return u.new_empty(u.shape), u.new_empty(u.shape)

    @torch.library.register_fake("triroute::whiten_heads_backward")
    def _(dz, s, var, gain, eps):
        return dz.new_empty(dz.shape), [dz.new_empty(g.shape) for g in gain], [dz.new_empty(g.shape) for g in gain]

    @torch.library.register_fake("triroute::rms_norm_backward")
    def _(dy, x, rstd, weight):
        return torch.empty_like(x), x.new_empty(x.shape[1])

    @torch.library.register_fake("triroute::decode_qkv")
    def _(x, wq, wk, wv, cos, sin, read=None):
        M, d = x.shape[0], cos.shape[1]
        return x.new_empty(M, wq.shape[0] // d, d), x.new_empty(M, wk.shape[0] // d, d), x.new_empty(M, wk.shape[0] // d, d)

    @torch.library.register_fake("triroute::decode_decisions")
    def _(attn_z, expert_z, bits_z, attn_shift, expert_shift, bits_shift, top_k, null_expert):
        B, T, Ha, M = attn_z.shape
        long = dict(dtype=torch.long)
        return [attn_z.new_empty(B, T, Ha, **long), attn_z.new_empty(B, T, Ha, M), attn_z.new_empty(B, T, **long),
                bits_z.new_empty(bits_z.shape), expert_z.new_empty(expert_z.shape), attn_z.new_empty(B, T, top_k, **long),
                attn_z.new_empty(B, T, top_k, **long), attn_z.new_empty(B, T, top_k),
                attn_z.new_empty(B, T, M + 1 + bits_z.shape[2])]

    @torch.library.register_fake("triroute::decode_layer")
    def _(x, attn_norm, attn_eps, wq, wk, wv, wo, cos, sin, mode, reach, option, rows, positions, counts, tables,
          page_size, k_data, k_scale, k_zero, v_data, v_scale, v_zero, token_pos, bits, group_size, sm_scale, counters,
          ffn_norm, ffn_eps, expert_index, expert_weight, w1, w3, w2):
        return torch.empty_like(x)

    @torch.library.register_fake("triroute::decode_layers")
    def _(x, side, cos, sin, rows, positions, attn_shift, expert_shift, bits_shift, weights, folds, state, given,
          n_layers, n_experts, n_pools, sizes, whitened, eps, reach, bits, group_size, page_size, sm_scale, top_k,
          null_expert):
        B, M, nb = side.shape[0], len(reach), sizes[2]
        Ha, E = sizes[0] // M, sizes[1]
        f32, i64 = dict(dtype=x.dtype), dict(dtype=torch.long)
        per_layer = [x.new_empty(B, sum(sizes), **f32), x.new_empty(B, 1, Ha, **i64), x.new_empty(B, 1, Ha, M, **f32),
                     x.new_empty(B, 1, **i64), x.new_empty(B, 1, nb, **f32), x.new_empty(B, 1, E, **f32),
                     x.new_empty(B, 1, top_k, **i64), x.new_empty(B, 1, top_k, **i64), x.new_empty(B, 1, top_k, **f32),
                     x.new_empty(B, 1, M + 1 + nb, **f32)]
        return [torch.empty_like(x)] + [t.clone() for _ in range(n_layers) for t in per_layer]

    _state["fakes"] = True
