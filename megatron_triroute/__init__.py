"""megatron-triroute: TriRoute transformers (joint attention / expert / KV-precision routing)
trained on Megatron-Core with DeepSpeed-MoE expert parallelism."""

from .config import BudgetConfig, ConfigError, LossConfig, ModelConfig, RouterConfig, TriRouteConfig
from .routing import BudgetController, TriRouteController, expected_cost, st_gumbel_softmax

__version__ = "0.1.0"

__all__ = [
    "BudgetConfig", "BudgetController", "ConfigError", "LossConfig", "ModelConfig", "RouterConfig",
    "TriRouteConfig", "TriRouteController", "expected_cost", "st_gumbel_softmax",
]
