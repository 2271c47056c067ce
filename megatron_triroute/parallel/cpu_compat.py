"""Workarounds that let Megatron-Core 0.16.1 and DeepSpeed 0.19.8 run on CPU with gloo, as one
scoped, version-checked context manager.

Both libraries are written for CUDA: they allocate on ``"cuda"`` by name, keep RNG states of the
CUDA generator and JIT-compile a CPU communication op. This module is the only place that knows;
model code never does. Entry points (the trainer, the overhead report, the test harness's workers)
run their work inside ``with cpu_shim():``. On a machine with CUDA it does nothing. On CPU it first
checks the library versions it was written for (another version fails with a message naming both,
since a patched function that moved would silently do the wrong thing), then applies each
workaround, and on exit restores every replaced attribute. Nested uses apply once.

Each workaround is one function whose comment gives the reason. They patch the libraries only:
functions and methods (including the aliases other megatron/deepspeed modules imported), the
``torch.cuda`` entry points Megatron calls unconditionally, and, in the Megatron modules that
hard-code ``device="cuda"``, the module's global ``torch``, replaced by a stand-in whose tensor
factories allocate on the CPU; ``Tensor.type`` only while the distributed optimizer's constructor
or Megatron's gradient clipping runs. ``initialize_parallel`` refuses to run on CPU outside the shim.
A version bump of either library starts by re-running ``tests/parallel/test_cpu_compat.py``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from typing import Any, Callable, Iterator

import torch

_MARK = "__triroute_cpu_workaround__"
SUPPORTED = {"megatron.core": "0.16.1", "deepspeed": "0.19.8"}
"""The library versions these workarounds were written for and tested against."""

_UNDO: list[tuple[Any, str, Any]] = []
"""(owner, attribute, original) for every replacement of the active shim, in application order."""
_DEPTH = 0


class UnsupportedLibraryVersion(RuntimeError):
    pass


@contextlib.contextmanager
def cpu_shim() -> Iterator[tuple[str, ...]]:
    """Apply every CPU workaround for the duration of the block (nothing when CUDA is available).

    Yields the names of the workarounds this call applied (none when CUDA is available or when an
    enclosing shim already applied them). Restores every patched attribute on exit.
    """
    global _DEPTH
    if torch.cuda.is_available():
        yield ()
        return
    applied: tuple[str, ...] = ()
    if _DEPTH == 0:
        check_library_versions()
        applied = tuple(workaround.__name__ for workaround in _WORKAROUNDS if workaround())
    _DEPTH += 1
    try:
        yield applied
    finally:
        _DEPTH -= 1
        if _DEPTH == 0:
            while _UNDO:
                owner, name, original = _UNDO.pop()
                setattr(owner, name, original)


def shim_active() -> bool:
    """True inside `cpu_shim()` on a CPU-only machine, and always where CUDA is available."""
    return torch.cuda.is_available() or _DEPTH > 0


def check_library_versions() -> None:
    """Fail clearly when Megatron-Core or DeepSpeed is not the version the workarounds were written for."""
    found = {name: importlib.import_module(name).__version__ for name in SUPPORTED}
    wrong = {name: v for name, v in found.items() if v != SUPPORTED[name]}
    if wrong:
        raise UnsupportedLibraryVersion(
            "the CPU workarounds (megatron_triroute/parallel/cpu_compat.py) were written for "
            + ", ".join(f"{n} {v}" for n, v in SUPPORTED.items()) + "; found "
            + ", ".join(f"{n} {v}" for n, v in found.items())
            + ". Fix: install the versions in constraints.txt, or check each workaround against the new "
            "version with tests/parallel/test_cpu_compat.py and update SUPPORTED.")


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
    return _allocate_on_cpu_in("megatron.core.transformer.utils")


def pipeline_schedules_on_cpu() -> bool:
    # Every forward-backward schedule allocates its token counter with `device="cuda"`.
    return _allocate_on_cpu_in("megatron.core.pipeline_parallel.schedules")


def distributed_optimizer_on_cpu() -> bool:
    # Megatron's distributed optimizer sorts parameters by `param.type()` against the CUDA type names
    # (any other name is refused) while it builds its shards, its gradient clipping asserts CUDA
    # gradients the same way, and the optimizer base class, the clipping and the local multi-tensor
    # L2 norm allocate small buffers with `device="cuda"`.
    changed = _replace_attr(importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer,
                            "__init__", _with_cuda_type_names)
    changed |= _rebind("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", _with_cuda_type_names)
    for module in ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads", "megatron.core.utils"):
        changed |= _allocate_on_cpu_in(module)
    return changed


def checkpoint_results_queue_is_forked() -> bool:
    # `dist_checkpointing` collects write results through a queue served by a *spawned* manager
    # process, which re-imports the trainer: about 3 s of a 2-core machine on each process's first
    # save, and as long again at exit, where the process waits for it (spawn protects CUDA state,
    # which a CPU run has none of). A forked manager serves the same queue at once.
    return _rebind("megatron.core.dist_checkpointing.strategies.filesystem_async", "_get_write_results_queue",
                   lambda original: _forked_results_queue)


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
    distributed_optimizer_on_cpu,
    checkpoint_results_queue_is_forked,
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


def _with_cuda_type_names(original: Callable) -> Callable:
    """`original` run with `Tensor.type()` naming a CPU tensor's type as its CUDA twin
    (`torch.FloatTensor` -> `torch.cuda.FloatTensor`); conversions (`type(dtype)`) are untouched."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        real_type = torch.Tensor.type

        def type_named_as_cuda(self: torch.Tensor, *type_args: Any, **type_kwargs: Any) -> Any:
            name = real_type(self, *type_args, **type_kwargs)
            if type_args or type_kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
                return name
            return name.replace("torch.", "torch.cuda.", 1)

        torch.Tensor.type = type_named_as_cuda
        try:
            return original(*args, **kwargs)
        finally:
            torch.Tensor.type = real_type

    return wrapper


_RESULTS_QUEUE: Any = None


def _forked_results_queue() -> Any:
    """One manager queue per process, as Megatron keeps one, served by a forked process that dies
    with the rank (`_serve_for_parent_only`)."""
    global _RESULTS_QUEUE
    if _RESULTS_QUEUE is None:
        import multiprocessing
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(_serve_for_parent_only, (os.getpid(),))
        _RESULTS_QUEUE = manager.Queue()
    return _RESULTS_QUEUE


def _serve_for_parent_only(parent: int) -> None:
    """The manager process's first act. A SIGKILLed rank cannot shut its manager down: without this
    the manager lives on as an orphan holding the rank's stdout and stderr, so a launcher reading
    them (srun) waits for it and the job's processes outlive it. The kernel kills the manager when
    the rank dies (`process_exit.die_with_parent`), and its output goes to /dev/null: it writes
    nothing a user needs."""
    from ..process_exit import die_with_parent

    die_with_parent(parent)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)


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


class _TorchAllocatingOnCpu:
    """Stands in for ``torch`` inside one library module: tensor factories asked for a CUDA device
    allocate on the CPU; every other attribute is the real ``torch``.

    Scoped to the module's global name, so the model code it calls runs on the real ``torch`` at full
    speed (running a schedule inside a TorchFunctionMode that did the same made a step 2.5x slower).
    """

    _FACTORIES = frozenset({"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint"})

    def __init__(self, real_torch: Any) -> None:
        self._real_torch = real_torch

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real_torch, name)
        if name not in self._FACTORIES:
            return attr

        @functools.wraps(attr)
        def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        self.__dict__[name] = factory  # later lookups skip __getattr__
        return factory


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index names a CUDA device
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _allocate_on_cpu_in(module_name: str) -> bool:
    module = importlib.import_module(module_name)
    if isinstance(module.torch, _TorchAllocatingOnCpu):
        return False
    _UNDO.append((module, "torch", module.torch))
    module.torch = _TorchAllocatingOnCpu(module.torch)
    return True


# --------------------------------------------------------------------------------------------
# Patching helpers (idempotent: a replacement carries a mark and is never wrapped twice; every
# replacement is recorded in _UNDO so the shim's exit restores it)


def _replace_attr(owner: Any, name: str, make: Callable[[Callable], Callable]) -> bool:
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return False
    _UNDO.append((owner, name, original))
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
        if getattr(other, name, None) is original and other is not module:
            _UNDO.append((other, name, original))
            setattr(other, name, replacement)
    _UNDO.append((module, name, original))
    setattr(module, name, replacement)
    return True


def _mark(fn: Callable) -> Callable:
    setattr(fn, _MARK, True)
    return fn
