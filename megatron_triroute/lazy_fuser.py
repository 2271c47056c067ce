"""Megatron-Core's fused functions compile on their first call, not when Megatron-Core is imported.

`megatron.core.jit` sets `jit_fuser = torch.compile`, and Megatron-Core decorates its fusion
functions with it as their modules are imported. Each decoration imports TorchDynamo and Inductor:
about two seconds of every process's start (every trainer rank, every tool), whether or not a
fused function ever runs. `install()`, called when this package is imported (it imports nothing
heavy), hands `megatron.core.jit` a `torch.compile` that defers to the real one at the function's
first call. torch.compile compiles on the first call anyway; only the import moves.
"""

from __future__ import annotations

import functools
import importlib.machinery
import sys
import types

MODULE = "megatron.core.jit"


def deferred_compile(compile_):
    """`compile_` (torch.compile) applied to a plain function at that function's first call, with
    the same arguments (a method too, decorated in its class body); anything else (a module, a bound
    method) is passed to `compile_` at once."""
    @functools.wraps(compile_)
    def compile_later(model=None, **kwargs):
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: compile_later(fn, **kwargs)
        if not isinstance(model, types.FunctionType):
            return compile_(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def run(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = compile_(model, **kwargs)
            return compiled(*args, **kw)
        return run
    return compile_later


class _Loader:
    """Runs `megatron.core.jit` with torch.compile deferred; its `jit_fuser` keeps the deferred one.
    (The import protocol's loader and finder, duck-typed: `importlib.abc` alone would add about
    10 ms to a launch before its stop-signal handlers are installed.)"""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):  # create_module, get_source, get_filename...: the file's own loader's
        return getattr(self.inner, name)

    def exec_module(self, module):
        import torch

        real = torch.compile
        torch.compile = deferred_compile(real)
        try:
            self.inner.exec_module(module)
        finally:
            torch.compile = real


class _Finder:
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Defer Megatron-Core's fusion compiles (module doc); a no-op once `megatron.core.jit` is loaded."""
    if MODULE not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
