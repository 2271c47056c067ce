"""Workarounds that let Megatron-Core 0.16.1 and DeepSpeed 0.19.8 run on CPU with gloo.

Both libraries are written for CUDA: they allocate on ``"cuda"`` by name, keep RNG states of the
CUDA generator, assert CUDA tensor types and JIT-compile a CPU communication op. This module is
the only place that knows; model code never does. Call :func:`apply_cpu_workarounds` once, early
(before building models); it does nothing when CUDA is available and is safe to call repeatedly.

Each workaround is one function whose comment gives the reason. They patch attributes of the
libraries (and every already-imported module that re-exports them under the same name), never
the project's own code. Version bumps of either library should start by re-running
``tests/parallel/test_cpu_compat.py``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

_MARK = "__triroute_cpu_workaround__"


def apply_cpu_workarounds() -> tuple[str, ...]:
    """Apply every CPU workaround when ``not torch.cuda.is_available()``.

    Returns the names of the workarounds applied by this call: all of them the first time on a CPU
    machine, none on a CUDA machine or on a second call.
    """
    if torch.cuda.is_available():
        return ()
    return tuple(workaround.__name__ for workaround in _WORKAROUNDS if workaround())


# --------------------------------------------------------------------------------------------
# torch.cuda entry points that Megatron calls unconditionally


def cuda_current_device_is_cpu() -> bool:
    # Megatron allocates on `torch.cuda.current_device()` (GlobalMemoryBuffer, RoPE inv_freq, the
    # MoE router, pipeline p2p shapes), which raises without CUDA; the CPU is the device here.
    return _replace_attr(torch.cuda, "current_device", lambda original: _current_device_cpu)


def cuda_synchronize_is_noop() -> bool:
    # p2p communication and dist_checkpointing call `torch.cuda.synchronize()`; CPU ops are
    # already complete when they return, so there is nothing to wait for.
    return _replace_attr(torch.cuda, "synchronize", lambda original: _synchronize_noop)


# --------------------------------------------------------------------------------------------
# Megatron-Core


def rng_tracker_keeps_cpu_states() -> bool:
    # `CudaRNGStatesTracker.add/fork` save and restore `torch.cuda` generator states ("Torch not
    # compiled with CUDA enabled"); on CPU the generator that dropout draws from is the CPU one.
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    changed = _rebind("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", lambda o: _get_cpu_rng_state)
    changed |= _rebind("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", lambda o: _set_cpu_rng_state)
    changed |= _replace_attr(random.CudaRNGStatesTracker, "add", lambda o: _tracker_add_cpu)
    changed |= _replace_attr(random.CudaRNGStatesTracker, "fork", lambda o: _tracker_fork_cpu)
    return changed


def manual_seed_also_seeds_cpu() -> bool:
    # `model_parallel_cuda_manual_seed` seeds the default device generator with the data-parallel
    # seed; on CPU that generator is the CPU one, else DP replicas initialise differently.
    return _rebind("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed", _seed_cpu_after)


def causal_masks_on_cpu() -> bool:
    # The default causal and sliding-window mask builders hard-code `device="cuda"`.
    changed = _rebind("megatron.core.transformer.utils", "get_default_causal_mask", _allocating_on_cpu)
    changed |= _rebind("megatron.core.transformer.utils", "get_sliding_window_causal_mask", _allocating_on_cpu)
    return changed


def pipeline_schedules_on_cpu() -> bool:
    # Every forward-backward schedule allocates its token counter with `device="cuda"`.
    schedules = "megatron.core.pipeline_parallel.schedules"
    changed = False
    for name in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        changed |= _rebind(schedules, name, _allocating_on_cpu)
    return changed


def grad_clipping_on_cpu() -> bool:
    # Grad-norm and zero counting allocate on `"cuda"`, and clipping asserts that every grad is a
    # `torch.cuda.FloatTensor`; CPU fp32 grads are `torch.FloatTensor`.
    clip_grads = "megatron.core.optimizer.clip_grads"
    changed = _rebind(clip_grads, "get_grad_norm_fp32", _allocating_on_cpu)
    changed |= _rebind(clip_grads, "count_zeros_fp32", _allocating_on_cpu)
    changed |= _rebind(clip_grads, "clip_grad_by_total_norm_fp32", lambda o: _clip_grad_by_total_norm_cpu)
    return changed


# --------------------------------------------------------------------------------------------
# DeepSpeed


def deepspeed_skips_shm_allreduce_op() -> bool:
    # DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce op on CPU (~45 s and a C++
    # toolchain on first use); gloo's own all-reduce is correct and enough for CPU runs.
    return _rebind("deepspeed.comm.torch", "build_shm_op", lambda original: _no_shm_op)


def deepspeed_all_gather_into_flat_buffer() -> bool:
    # DeepSpeed's MoE `gather_tokens` all-gathers an (e, c, m) tensor into a flat buffer; gloo
    # requires the output shaped (world * e, c, m), so view the buffer that way first.
    torch_backend = importlib.import_module("deepspeed.comm.torch").TorchBackend
    return _replace_attr(torch_backend, "all_gather_into_tensor", _gathering_into_stacked_view)


_WORKAROUNDS: tuple[Callable[[], bool], ...] = (
    cuda_current_device_is_cpu,
    cuda_synchronize_is_noop,
    rng_tracker_keeps_cpu_states,
    manual_seed_also_seeds_cpu,
    causal_masks_on_cpu,
    pipeline_schedules_on_cpu,
    grad_clipping_on_cpu,
    deepspeed_skips_shm_allreduce_op,
    deepspeed_all_gather_into_flat_buffer,
)


# --------------------------------------------------------------------------------------------
# Replacements


def _current_device_cpu() -> torch.device:
    return torch.device("cpu")


def _synchronize_noop(device: Any = None) -> None:
    return None


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()  # already a copy


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _tracker_add_cpu(self, name: str, seed: int) -> None:
    """Track a new named RNG state seeded with ``seed``, leaving the live CPU state untouched."""
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self._is_initialized = True
    self.seeds_.add(seed)
    live = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(live)


@contextlib.contextmanager
def _tracker_fork_cpu(self, name: str = "model-parallel-rng"):
    """Draw from the tracked state ``name`` inside the block, then restore the outer state.

    Nested forks work as a stack: each saves the live CPU state on entry and restores it on exit.
    """
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    outer_state, outer_name = torch.get_rng_state(), self._current_state_name
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer_state)
        self._current_state_name = outer_name


def _seed_cpu_after(original: Callable) -> Callable:
    @functools.wraps(original)
    def model_parallel_cuda_manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:
        original(seed, *args, **kwargs)
        torch.manual_seed(seed)

    return model_parallel_cuda_manual_seed


def _clip_grad_by_total_norm_cpu(
    parameters: list[torch.Tensor] | torch.Tensor,
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Scale grads in place by ``max_norm / total_norm`` when that is below 1 (Megatron's contract)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _no_shm_op() -> None:
    return None


def _gathering_into_stacked_view(original: Callable) -> Callable:
    @functools.wraps(original)
    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        if output_tensor.dim() == 1 and input_tensor.dim() > 1:
            world = output_tensor.numel() // max(1, input_tensor.numel())
            output_tensor = output_tensor.view(world * input_tensor.shape[0], *input_tensor.shape[1:])
        return original(self, output_tensor, input_tensor, group=group, async_op=async_op)

    return all_gather_into_tensor


class _CudaAllocationsOnCpu(TorchFunctionMode):
    """Inside this mode, tensors requested on a CUDA device are created on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index names a CUDA device
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _allocating_on_cpu(original: Callable) -> Callable:
    @functools.wraps(original)
    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        with _CudaAllocationsOnCpu():
            return original(*args, **kwargs)

    return on_cpu


# --------------------------------------------------------------------------------------------
# Patching helpers (idempotent: a replacement carries a mark and is never wrapped twice)


def _replace_attr(owner: Any, name: str, make: Callable[[Callable], Callable]) -> bool:
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return False
    setattr(owner, name, _mark(make(original)))
    return True


def _rebind(module_name: str, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Replace ``module.name`` and every imported megatron/deepspeed alias of the same object."""
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    if getattr(original, _MARK, False):
        return False
    replacement = _mark(make(original))
    for other_name, other in list(sys.modules.items()):
        if other is None or not other_name.startswith(("megatron.", "deepspeed.")):
            continue
        if getattr(other, name, None) is original:
            setattr(other, name, replacement)
    setattr(module, name, replacement)
    return True


def _mark(fn: Callable) -> Callable:
    setattr(fn, _MARK, True)
    return fn
