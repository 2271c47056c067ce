"""One place that maps `router.kind` to the module that makes a layer's decisions.

Every router family is built as `(config, layer_number)` (0-based layer) and called as
`(hidden (B, T, d), side (B, T, F), noise_key, tau, prev) -> RouterOutput`, so the layers and
the cost/loss code never branch on the family.
"""

from __future__ import annotations

from torch import nn

from ..config import TriRouteConfig
from .controller import TriRouteController


def build_controller(config: TriRouteConfig, layer_number: int) -> nn.Module:
    kind = config.router.kind
    if kind == "triroute":
        return TriRouteController(config, layer_number)
    if kind == "mod":
        from .mod import MoDController

        return MoDController(config, layer_number)
    if kind == "independent":
        from .independent import IndependentController

        return IndependentController(config, layer_number)
    raise NotImplementedError(f"router.kind={kind!r} has no controller; use triroute, mod or independent")
