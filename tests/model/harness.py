"""Builders shared by the Megatron-integration tests (run inside gloo processes)."""

import re

import torch

from megatron_triroute.config import TriRouteConfig


def tiny_triroute(**router) -> TriRouteConfig:
    cfg = TriRouteConfig()
    m = cfg.model
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size, m.seq_len = 32, 2, 4, 2, 64, 64, 12
    r = cfg.router
    r.d_router, r.num_experts, r.window, r.kv_group_size = 16, 4, 3, 8
    for k, v in router.items():
        setattr(r, k, v)
    return cfg.validate()


def build(cfg: TriRouteConfig, tp=1, pp=1, ep=1, seed=1234, recompute=False):
    """Initialise parallel state and build the TriRoute GPT (this rank's stage)."""
    from megatron.core import parallel_state

    from megatron_triroute.model.gpt import TriRouteGPTModel
    from megatron_triroute.model.spec import transformer_config
    from megatron_triroute.parallel import initialize_parallel

    groups = initialize_parallel(tp, pp, ep)
    torch.manual_seed(seed)
    mcfg = transformer_config(cfg, tensor_parallel=tp, pipeline_parallel=pp, recompute=recompute)
    model = TriRouteGPTModel(
        mcfg, cfg, groups=groups,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
    )
    return model, groups


def batch(cfg: TriRouteConfig, n: int = 2, seed: int = 0, offset: int = 0):
    g = torch.Generator().manual_seed(seed)
    T, V = cfg.model.seq_len, cfg.model.vocab_size
    tokens = torch.randint(0, V, (n, T + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.arange(offset, offset + n)


def decision_margin(cfg: TriRouteConfig, decisions, idx: torch.Tensor, step: int = 0) -> float:
    """Smallest gap between an executed option and its runner-up over every decision of one forward.

    `decisions` holds per layer (attn y, bits y, expert index, expert weight, attn logits, bits
    logits, expert probs); the noise is recomputed from the step's key. A gap near zero means a
    decision another layout could flip by rounding alone.
    """
    from megatron_triroute.routing.noise import NoiseKey

    T = cfg.model.seq_len
    gaps = []
    for layer, (_, _, _, _, za, zb, probs) in enumerate(decisions):
        key = NoiseKey(cfg.seed, step, layer, idx, torch.arange(T))
        for z, axis in ((za, 0), (zb, 2)):
            top2 = (z + key.gumbel(tuple(z.shape), axis)).topk(2, -1).values
            gaps.append((top2[..., 0] - top2[..., 1]).min())
        top = probs.sort(-1, descending=True).values
        gaps.append((top[..., cfg.router.top_k - 1] - top[..., cfg.router.top_k]).min())
    return min(g.item() for g in gaps)


_STACKED = re.compile(r"(.*moe\.experts\.)(w[123]\.weight)")


def by_global_expert(name: str, tensor: torch.Tensor, first: int) -> dict[str, torch.Tensor]:
    """A named parameter (or its gradient) keyed per global expert where it is a layer's stacked
    expert weight (`…moe.experts.w1.weight` -> `…moe.experts.<first + i>.w1.weight`: local expert
    i of a rank whose first expert is global `first`); any other name as it is."""
    m = _STACKED.fullmatch(name)
    if m is None:
        return {name: tensor}
    return {f"{m[1]}{first + i}.{m[2]}": t for i, t in enumerate(tensor.unbind(0))}
