"""MegatronGradSync (Megatron-Core's DDP over our DP/EDP groups) against reduce_gradients, the flat
all-reduce: the same gradient for dense and expert parameters at DP2 x EP1 and DP2 x EP2, with two
micro-batches accumulated under `no_sync`, with and without overlap; with one-parameter buckets the
buckets are launched during the backward, not after it."""

import pytest

from tests.dist_utils import run_distributed
from tests.parallel.test_grad_reduce import D_MODEL, TOKENS_PER_RANK, _loss, _tiny_moe_model, _union_batch

TOL = dict(rtol=0, atol=1e-6)


def _with_config(model):
    """Megatron's DDP reads the module's TransformerConfig (per-token loss, bucketing, no_sync_func)."""
    from megatron.core.transformer import TransformerConfig

    model.config = TransformerConfig(num_layers=1, hidden_size=D_MODEL, num_attention_heads=1,
                                     use_cpu_initialization=True)
    return model


def _accumulate(model, sync, x, index, target) -> list[int]:
    """Two micro-batches (the first under no_sync, as Megatron's schedule runs them); returns how
    many buckets had their reduction launched when the last backward returned."""
    half = TOKENS_PER_RANK // 2
    micro = [slice(0, half), slice(half, TOKENS_PER_RANK)]
    with model.config.no_sync_func() if sync is not None else _nothing():
        (_loss(model, x[micro[0]], index[micro[0]], target[micro[0]]) / 2).backward()
    (_loss(model, x[micro[1]], index[micro[1]], target[micro[1]]) / 2).backward()
    if sync is None:
        return []
    groups = sync.ddp.bucket_groups + sync.ddp.expert_parallel_bucket_groups
    return [g.grad_reduce_handle is not None for g in groups]


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _check_megatron_matches_flat_all_reduce(rank, world_size):
    import torch

    from megatron_triroute.parallel import destroy_parallel, initialize_parallel, reduce_gradients
    from megatron_triroute.parallel.megatron_ddp import MegatronGradSync

    x, index, target = _union_batch()
    mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    x, index, target = x[mine], index[mine], target[mine]
    for ep in (1, 2):
        groups = initialize_parallel(expert_parallel=ep)
        reference = _tiny_moe_model(groups)
        _accumulate(reference, None, x, index, target)
        reduce_gradients(reference, groups)
        expected = {n: p.grad for n, p in reference.named_parameters()}
        for overlap in (False, True):
            model = _with_config(_tiny_moe_model(groups))
            sync = MegatronGradSync(model, groups, overlap_grad_reduce=overlap, bucket_size=1)
            for step in range(2):  # step 0 is Megatron's first batch (it learns the bucket order)
                sync.begin()
                launched = _accumulate(model, sync, x, index, target)
                sync.finish()
                for name, param in model.named_parameters():
                    torch.testing.assert_close(param.grad, expected[name], **TOL,
                                               msg=f"ep={ep} overlap={overlap} step={step} {name}")
            experts = [p for p in model.parameters() if getattr(p, "allreduce", True) is False]
            assert [p.shape[0] for p in experts] == [4 // ep] * 3  # w1, w3, w2 over this rank's experts
            assert len(sync.ddp.expert_parallel_buffers) == 1
            if overlap:  # after the first step every bucket is launched by the backward's hooks
                assert launched and all(launched), launched
            else:
                assert not any(launched), launched
        destroy_parallel()


@pytest.mark.distributed
def test_megatron_ddp_grads_equal_the_flat_all_reduce():
    run_distributed(_check_megatron_matches_flat_all_reduce, 2)


def _check_wrong_scaling_is_refused(rank, world_size):
    from megatron_triroute.parallel import destroy_parallel, initialize_parallel
    from megatron_triroute.parallel.megatron_ddp import MegatronGradSync, check_scaling

    groups = initialize_parallel(expert_parallel=2)
    sync = MegatronGradSync(_with_config(_tiny_moe_model(groups)), groups)
    sync.ddp.expert_parallel_buffers[0].buckets[0].gradient_scaling_factor = 1.0 / groups.edp
    with pytest.raises(RuntimeError, match="expected 1/dp = 1/2"):
        check_scaling(sync.ddp, groups)
    destroy_parallel()


@pytest.mark.distributed
def test_a_bucket_scaled_by_one_over_edp_is_refused():
    run_distributed(_check_wrong_scaling_is_refused, 2)
