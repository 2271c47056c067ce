"""Small configs and builders shared by the routing tests."""

import torch

from megatron_triroute.config import TriRouteConfig
from megatron_triroute.routing.side_features import N_STATIC_FEATURES, decision_feature_size


def tiny_config(**router_overrides) -> TriRouteConfig:
    cfg = TriRouteConfig()
    cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads = 32, 2, 4, 2
    cfg.model.d_ff, cfg.model.vocab_size, cfg.model.seq_len = 64, 50, 12
    cfg.router.d_router, cfg.router.num_experts, cfg.router.window = 16, 4, 3
    cfg.router.kv_group_size = 4
    for k, v in router_overrides.items():
        setattr(cfg.router, k, v)
    return cfg.validate()


def side_dim(cfg: TriRouteConfig) -> int:
    return N_STATIC_FEATURES + decision_feature_size(len(cfg.router.bits))


def make_inputs(cfg: TriRouteConfig, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = cfg.model.seq_len
    hidden = torch.randn(batch, T, cfg.model.d_model, generator=g)
    side = torch.randn(batch, T, side_dim(cfg), generator=g)
    return hidden, side
