"""The routing ops `router.compile` compiles: the counter-based noise and the ST-Gumbel relaxation.

Both are pure tensor functions of fixed shapes with no Python number that changes between steps
or layers (the noise's step and layer arrive folded into a tensor, the temperature as a tensor), so
one compiled graph serves every layer of a shape and every step. The controller's linear layers,
whitening and gradient balance stay eager: they are matmuls and running-statistic bookkeeping,
where a compiler has little to fuse.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .gumbel import soft_gumbel_sample, straight_through
from .noise import counter_gumbel

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""torch.compile backends `router.compile` accepts: inductor generates fused kernels; aot_eager and
eager trace without generating code (a check that the ops compile, at no build cost)."""


def relaxed_decision(z_model: torch.Tensor, z: torch.Tensor, noise: torch.Tensor,
                     tau: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ST-Gumbel sample of both views of an axis (Sec. relax): the model path from the
    gradient-balanced logits, the budget path from the raw ones; the same forward value."""
    y = straight_through(soft_gumbel_sample(z_model, noise, tau))
    y_cost = straight_through(soft_gumbel_sample(z, noise, tau))
    return y, y_cost


@dataclass(frozen=True)
class RoutingOps:
    noise: Callable[..., torch.Tensor]
    """`noise.counter_gumbel` or its compiled twin."""
    relax: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """`relaxed_decision` or its compiled twin; takes the temperature as a 0-d tensor when compiled."""
    compiled: bool


EAGER = RoutingOps(counter_gumbel, relaxed_decision, compiled=False)


@functools.lru_cache(maxsize=None)
def routing_ops(backend: str | None) -> RoutingOps:
    """The routing ops for `router.compile` (None: eager). One compiled function per backend,
    shared by every layer, so layers of one shape share one graph."""
    if backend is None:
        return EAGER
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"router.compile={backend!r}: not a torch.compile backend this accepts. "
                         f"Fix: use one of {COMPILE_BACKENDS}, or leave it unset (eager).")
    compile_ = functools.partial(torch.compile, backend=backend, dynamic=False)
    return RoutingOps(compile_(counter_gumbel), compile_(relaxed_decision), compiled=True)
