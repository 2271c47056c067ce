"""The routing ops `router.compile` compiles: the counter-based noise, the ST-Gumbel relaxation
and the K/V quantisation of the relaxed write (every width of every token, `quant.quantized_values`).

All three are pure tensor functions of fixed shapes with no Python number that changes between
steps or layers (the noise's step and layer arrive folded into a tensor, the temperature as a
tensor), so one compiled graph serves every layer of a shape and every step. Eager, the
quantisation is a chain of a dozen elementwise passes over float32 copies of K and V at three widths,
which inductor fuses. The controller's linear layers, whitening and
gradient balance stay eager: they are matmuls and running-statistic bookkeeping, where a compiler
has little to fuse.

`auto` compiles with inductor for tensors on a GPU and runs eagerly elsewhere (on a CPU the
compiled ops measured no faster, docs/overhead.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ROUTER_COMPILE
from .gumbel import straight_through_pair
from .noise import counter_gumbel
from .quant import quantized_values

COMPILE_BACKENDS = tuple(b for b in ROUTER_COMPILE if b != "auto")
"""torch.compile backends `router.compile` names: inductor generates fused kernels; aot_eager and
eager trace without generating code (a check that the ops compile, at no build cost). `auto` is
inductor on a GPU, eager elsewhere."""


def relaxed_decision(z_model: torch.Tensor, z: torch.Tensor, noise: torch.Tensor,
                     tau: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ST-Gumbel sample of both views of an axis (Sec. relax): the model path from the
    gradient-balanced logits, the budget path from the raw ones; the same forward value
    (`gumbel.straight_through_pair`: one sample, each view's own gradient)."""
    return straight_through_pair(z_model, z, noise, tau)


@dataclass(frozen=True)
class RoutingOps:
    noise: Callable[..., torch.Tensor]
    """`noise.counter_gumbel` or its compiled twin."""
    relax: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """`relaxed_decision` or its compiled twin; takes the temperature as a 0-d tensor when compiled."""
    quantize: Callable[..., torch.Tensor]
    """`quant.quantized_values` or its compiled twin."""
    compiled: bool


EAGER = RoutingOps(counter_gumbel, relaxed_decision, quantized_values, compiled=False)


def _by_device(eager: Callable, compiled: Callable) -> Callable:
    """`compiled` where the first tensor argument lives on a GPU, `eager` elsewhere."""
    @functools.wraps(eager)
    def run(*args, **kwargs):
        return (compiled if args[0].is_cuda else eager)(*args, **kwargs)
    return run


@functools.lru_cache(maxsize=None)
def routing_ops(backend: str | None) -> RoutingOps:
    """The routing ops for `router.compile` (None: eager; `auto`: inductor on a GPU, eager
    elsewhere). One compiled function per backend, shared by every layer, so layers of one shape
    share one graph."""
    if backend is None:
        return EAGER
    if backend == "auto":
        fast = routing_ops("inductor")
        return RoutingOps(*(_by_device(e, c) for e, c in zip((counter_gumbel, relaxed_decision, quantized_values),
                                                               (fast.noise, fast.relax, fast.quantize))),
                          compiled=True)
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"router.compile={backend!r}: not a torch.compile backend this accepts. "
                         f"Fix: use one of {ROUTER_COMPILE}, or leave it unset (eager).")
    compile_ = functools.partial(torch.compile, backend=backend, dynamic=False)
    return RoutingOps(compile_(counter_gumbel), compile_(relaxed_decision), compile_(quantized_values), compiled=True)
