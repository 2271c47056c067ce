"""megatron-triroute: TriRoute transformers (joint attention / expert / KV-precision routing)
trained on Megatron-Core with DeepSpeed-MoE expert parallelism.

The top-level names are resolved lazily: `import megatron_triroute.training.signals` must not
import torch, so stop signals can be handled from the first line of a launched process.
Importing it defers Megatron-Core's fusion compiles to their first call (`lazy_fuser`).
"""

from importlib import import_module

from .lazy_fuser import install as _defer_megatron_fusion_compiles

_defer_megatron_fusion_compiles()

__version__ = "0.1.0"

_EXPORTS = {
    "BudgetConfig": ".config", "ConfigError": ".config", "LossConfig": ".config", "ModelConfig": ".config",
    "RouterConfig": ".config", "TriRouteConfig": ".config",
    "BudgetController": ".routing", "TriRouteController": ".routing", "expected_cost": ".routing",
    "st_gumbel_softmax": ".routing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron_triroute' has no attribute {name!r}")
