"""The one place a TriRoute layer's Megatron-Core ModuleSpec is built.

`get_triroute_layer_spec(config, groups)` returns a ModuleSpec whose module runs
controller -> routed attention -> experts. Linears are Megatron's tensor-parallel ones; the
experts are DeepSpeed-MoE (`TriRouteExperts`) when the expert axis is routed, otherwise a dense
SwiGLU Megatron MLP. When Transformer Engine imports (GPU clusters), its linears and norms are
used instead of the local ones.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import TriRouteConfig
from ..routing.cost import expert_width
from .attention import RoutedAttentionSubmodules, TriRouteSelfAttention
from .layer import TriRouteLayerSubmodules, TriRouteTransformerLayer

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
"""Transformer Engine (GPU-only acceleration) is installed. Megatron's TE wrappers import without
it and only fail when instantiated, so the package itself is what we look for."""
if HAVE_TE:  # pragma: no cover - GPU clusters only
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm, TERowParallelLinear
else:
    TEColumnParallelLinear = TENorm = TERowParallelLinear = None


class DenseFFN(MegatronModule):
    """Dense SwiGLU FFN (Megatron MLP), for systems without expert routing."""

    def __init__(self, config: TransformerConfig, triroute: TriRouteConfig, linears=(ColumnParallelLinear, RowParallelLinear)):
        super().__init__(config=config)
        self.mlp = MLP(config, MLPSubmodules(linear_fc1=linears[0], linear_fc2=linears[1]),
                       ffn_hidden_size=triroute.model.d_ff)

    def forward(self, hidden):
        out, bias = self.mlp(hidden)
        return out if bias is None else out + bias


class RoutedExperts(MegatronModule):
    """The controller-routed experts on DeepSpeed-MoE (built lazily so CPU-only imports stay light)."""

    def __init__(self, config: TransformerConfig, triroute: TriRouteConfig, groups=None):
        super().__init__(config=config)
        from ..experts.deepspeed_moe import TriRouteExperts

        r = triroute.router
        self.experts = TriRouteExperts(
            triroute.model.d_model, expert_width(triroute.model, r), r.num_experts, groups=groups,
            capacity_factor=None, init_method=config.init_method,
            output_init_method=config.output_layer_init_method, top_k=r.top_k,
            sequence_parallel=config.sequence_parallel, compute=r.expert_compute,
        )

    def forward(self, hidden, expert_index, expert_weight):
        """hidden (N, d); expert_index/weight (N, k), index -1 = the null expert (nothing runs)."""
        return self.experts(hidden, expert_index, expert_weight)




def get_triroute_layer_spec(config: TriRouteConfig, groups=None, use_te: bool | None = None) -> ModuleSpec:
    """ModuleSpec of one TriRoute layer from the config tree (`groups`: ParallelGroups for EP)."""
    use_te = HAVE_TE if use_te is None else use_te
    if use_te and not HAVE_TE:
        raise ImportError("use_te=True but Transformer Engine is not importable; install the 'gpu' extra")
    column, row, norm = (TEColumnParallelLinear, TERowParallelLinear, TENorm) if use_te else (
        ColumnParallelLinear, RowParallelLinear, WrappedTorchNorm)
    if config.router.expert_routing:
        mlp = ModuleSpec(module=RoutedExperts, params={"groups": groups})
    else:
        mlp = ModuleSpec(module=DenseFFN, params={"linears": (column, row)})
    return ModuleSpec(
        module=TriRouteTransformerLayer,
        params={"triroute": config},
        submodules=TriRouteLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=TriRouteSelfAttention,
                submodules=RoutedAttentionSubmodules(linear_qkv=column, linear_proj=row),
            ),
            pre_mlp_layernorm=norm,
            mlp=mlp,
        ),
    )


def get_triroute_block_spec(config: TriRouteConfig, megatron_config: TransformerConfig, groups=None,
                            use_te: bool | None = None, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """TransformerBlockSubmodules for this pipeline stage: its share of TriRoute layer specs and
    the final RMSNorm, for Megatron's own TransformerBlock to build."""
    use_te = HAVE_TE if use_te is None else use_te
    layer = get_triroute_layer_spec(config, groups, use_te)
    n = get_num_layers_to_build(megatron_config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=TENorm if use_te else WrappedTorchNorm)


def transformer_config(config: TriRouteConfig, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                       recompute: bool = False,
                       **overrides) -> TransformerConfig:
    """Megatron TransformerConfig for the backbone described by `config.model`.

    Fused CUDA paths are off (they are CPU-incompatible and the routed layer does not use them);
    on GPU clusters TE's linears come in through the spec instead. Parameters are always fp32
    (the optimizer's master copy); bf16 training runs the forward under autocast (see
    training.engine), with the controller opting out so the router computes in fp32.
    """
    m = config.model
    kwargs = dict(
        num_layers=m.n_layers, hidden_size=m.d_model, num_attention_heads=m.n_heads,
        num_query_groups=m.n_kv_heads, kv_channels=m.d_head, ffn_hidden_size=m.d_ff,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5, init_method_std=0.02,
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        # Experts are DeepSpeed-MoE modules placed by `parallel.groups`; Megatron's own layers
        # never see an expert, so its config keeps expert_model_parallel_size=1.
        expert_model_parallel_size=1, sequence_parallel=False,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, bf16=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None, recompute_num_layers=1 if recompute else None,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
