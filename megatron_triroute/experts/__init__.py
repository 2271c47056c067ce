"""Expert layers driven by TriRoute's precomputed routes (the null expert is index -1)."""

from megatron_triroute.experts.deepspeed_moe import NULL_EXPERT, PrecomputedGate, TriRouteExperts
from megatron_triroute.experts.stacked import StackedExperts, swiglu

__all__ = ["NULL_EXPERT", "PrecomputedGate", "StackedExperts", "TriRouteExperts", "swiglu"]
