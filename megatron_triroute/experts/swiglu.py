"""One SwiGLU feed-forward expert: ``w2(silu(w1 x) * w3 x)``, no biases."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

InitMethod = Callable[[torch.Tensor], object]  # Megatron convention: initialise a tensor in place

default_init_method: InitMethod = functools.partial(nn.init.normal_, mean=0.0, std=0.02)


class SwiGLUExpert(nn.Module):
    """A gated feed-forward block; ``d_expert`` is the hidden width of one expert."""

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
    ) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_expert, bias=False)  # gate projection
        self.w3 = nn.Linear(d_model, d_expert, bias=False)  # value projection
        self.w2 = nn.Linear(d_expert, d_model, bias=False)  # output projection
        self.reset_parameters(init_method, output_init_method)

    def reset_parameters(
        self, init_method: InitMethod | None = None, output_init_method: InitMethod | None = None
    ) -> None:
        """Initialise w1 and w3 with ``init_method`` and w2 with ``output_init_method`` (default: the same)."""
        init_method = init_method or default_init_method
        with torch.no_grad():
            init_method(self.w1.weight)
            init_method(self.w3.weight)
            (output_init_method or init_method)(self.w2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_model) -> (..., d_model)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
