"""The TriRoute routing core: pure PyTorch, no Megatron-Core or DeepSpeed import.

One module per piece of the paper's Method section; each function's docstring cites its equation.
"""

from .budget import BudgetController
from .controller import AxisDecision, RouterOutput, TriRouteController, decision_features
from .cost import HardCost, LayerCost, budget_fractions, dense_cost, expected_cost, hard_cost, noise_free_cost
from .gating import NULL_EXPERT, ExpertRoutes, top_k_gating
from .gumbel import st_gumbel_softmax, temperature_at
from .losses import entropy_floor_loss, router_aux_loss, router_z_loss, switch_load_loss
from .noise import NoiseKey
from .quant import fake_quantize, kv_bits_per_token, relaxed_kv_write
from .running_stats import commit_running_statistics
from .side_features import TokenTables, static_side_features

__all__ = [
    "AxisDecision", "BudgetController", "ExpertRoutes", "HardCost", "LayerCost", "NULL_EXPERT", "NoiseKey",
    "RouterOutput", "TokenTables", "TriRouteController", "budget_fractions", "commit_running_statistics",
    "decision_features", "dense_cost", "entropy_floor_loss", "expected_cost", "fake_quantize", "hard_cost",
    "kv_bits_per_token", "noise_free_cost", "relaxed_kv_write", "router_aux_loss", "router_z_loss",
    "st_gumbel_softmax", "static_side_features", "switch_load_loss", "temperature_at", "top_k_gating",
]
