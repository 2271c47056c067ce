"""Router scalars from a step's per-layer statistics: entropies by hand, and no entropy (nor a
collapse warning) for a layer that makes no decision on an axis (a layer-group follower)."""

import math

import pytest
import torch

from megatron_triroute.config import TriRouteConfig
from megatron_triroute.model.routing_step import RouterStatistics
from megatron_triroute.training.metrics import collapse_warnings, router_scalars


def test_a_layer_without_the_axis_has_no_entropy_and_no_collapse_warning():
    cfg = TriRouteConfig()
    cfg.model.n_layers = 2
    cfg.router.attn_granularity, cfg.router.layer_group_size = "layer_group", 2
    cfg = cfg.validate()
    sl = RouterStatistics(cfg).slices()
    width = max(s.stop for s in sl.values())
    stats = torch.zeros(2, width, dtype=torch.float64)
    stats[:, sl["tokens"]] = 10.0
    stats[0, sl["attn/prob"]] = torch.tensor([2.0, 3.0, 5.0])  # the leader; layer 1 follows it
    scalars, entropies = router_scalars(stats, cfg)
    p = [0.2, 0.3, 0.5]
    assert entropies["attn"][0] == pytest.approx(-sum(x * math.log(x) for x in p) / math.log(3))
    assert math.isnan(entropies["attn"][1])
    assert "router/attn/entropy/layer_0" in scalars and "router/attn/entropy/layer_1" not in scalars
    assert collapse_warnings({"attn": entropies["attn"]}, 0.1) == []
    assert collapse_warnings({"attn": [0.05, float("nan")]}, 0.1) == [
        "router collapse: axis 'attn' in layer 0 has normalised entropy 0.050 < 0.1"]
