"""Process groups: layout validation, Megatron-Core and DeepSpeed agreeing on every rank list, and the
expert layer under tensor x expert parallel (4 gloo processes)."""

import pytest

from megatron_triroute.parallel import ParallelLayoutError, initialize_parallel, validate_layout
from tests.dist_utils import run_distributed


def expected_layout(world_size: int, tp: int, pp: int, ep: int, rank: int) -> dict:
    """The documented layout, derived independently of both libraries."""
    stage_size = world_size // pp
    stage_start, i = rank - rank % stage_size, rank % stage_size
    return {
        "tp": tuple(rank - rank % tp + j for j in range(tp)),
        "dp": tuple(stage_start + i % tp + tp * j for j in range(stage_size // tp)),
        "ep": tuple(stage_start + i - i % ep + j for j in range(ep)),
        "edp": tuple(stage_start + i % ep + ep * j for j in range(stage_size // ep)),
    }


def _check_layout(groups, world_size, tp, pp, ep):
    import torch.distributed as dist
    from deepspeed.utils import groups as ds_groups
    from megatron.core import parallel_state

    expected = expected_layout(world_size, tp, pp, ep, groups.rank)
    megatron = {
        "tp": parallel_state.get_tensor_model_parallel_group(),
        "dp": parallel_state.get_data_parallel_group(),
        "ep": parallel_state.get_expert_model_parallel_group(),
        "edp": parallel_state.get_expert_data_parallel_group(),
    }
    for key, group in megatron.items():
        assert tuple(dist.get_process_group_ranks(group)) == expected[key], (key, tp, pp, ep)
    name = f"ep_size_{ep}"
    assert groups.ep_group_name == name
    assert tuple(ds_groups._get_expert_parallel_group_ranks(name)) == expected["ep"]
    assert tuple(ds_groups._get_expert_data_parallel_group_ranks(name)) == expected["edp"]
    assert (groups.tp_ranks, groups.dp_ranks, groups.ep_ranks, groups.edp_ranks) == (
        expected["tp"], expected["dp"], expected["ep"], expected["edp"])
    assert (groups.tp, groups.pp, groups.ep) == (tp, pp, ep)
    assert groups.dp == world_size // (tp * pp) and groups.edp == world_size // (ep * pp)
    assert groups.ep_rank == expected["ep"].index(groups.rank)
    assert groups.edp_rank == expected["edp"].index(groups.rank)
    assert ds_groups.mpu.get_tensor_model_parallel_world_size() == tp


def _check_two_process_layouts(rank, world_size):
    import dataclasses

    import deepspeed.comm
    from deepspeed.utils import groups as ds_groups

    from megatron_triroute.parallel import GroupMismatchError, destroy_parallel
    from megatron_triroute.parallel.groups import check_deepspeed_matches_megatron

    for tp, pp, ep in ((1, 1, 2), (1, 2, 1), (2, 1, 1), (1, 1, 1)):
        groups = initialize_parallel(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
        _check_layout(groups, world_size, tp, pp, ep)
        if pp == 2:
            _check_pipeline_schedule_runs(groups)
        with pytest.raises(RuntimeError, match="destroy_parallel"):
            initialize_parallel(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
        destroy_parallel()
    assert deepspeed.comm.is_initialized() and not ds_groups._get_expert_parallel_group_dict()
    assert ds_groups.mpu is None

    # A DeepSpeed rank order that drifts from Megatron's is caught, with both lists in the message.
    groups = initialize_parallel(expert_parallel=2)
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS["ep_size_2"] = [1, 0]
    with pytest.raises(GroupMismatchError, match=r"expert-parallel group \[1, 0\] differs .* \[0, 1\]"):
        check_deepspeed_matches_megatron(groups)
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS["ep_size_2"] = [0, 1]
    with pytest.raises(GroupMismatchError, match="expert-data-parallel"):
        check_deepspeed_matches_megatron(dataclasses.replace(groups, edp_ranks=(0, 1)))
    destroy_parallel()


def _check_pipeline_schedule_runs(groups):
    """Megatron's 1F1B schedule over two gloo stages (p2p shapes, token counters, RNG tracker on CPU)."""
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(3)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, persist_layer_norm=False, pipeline_model_parallel_size=groups.pp,
        pipeline_dtype=torch.float32,
    )
    last_stage = parallel_state.is_pipeline_last_stage()
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                     position_embedding_type="rope", pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=last_stage, share_embeddings_and_output_weights=False)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)

    def forward_step(data_iterator, model):
        per_token = model(tokens, positions, None, labels=tokens)
        return per_token, lambda out: (out.float().mean(), {"loss": out.float().mean().detach()})

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None, None]), model=[model], num_microbatches=2,
        seq_length=16, micro_batch_size=2, forward_only=False,
    )
    assert len(losses) == (2 if last_stage else 0)
    assert all(torch.isfinite(loss["loss"]) for loss in losses)
    assert all(param.grad is not None for param in model.parameters())  # gradients crossed the stages


def _check_four_process_layouts(rank, world_size):
    from megatron_triroute.parallel import destroy_parallel

    groups = initialize_parallel(tensor_parallel=2, expert_parallel=2)
    _check_layout(groups, world_size, 2, 1, 2)
    # tp {0,1} {2,3}; dp {0,2} {1,3}; ep {0,1} {2,3}; edp {0,2} {1,3}
    assert groups.ep_ranks == groups.tp_ranks and groups.edp_ranks == groups.dp_ranks
    _check_expert_layer_tp2_ep2(groups)
    destroy_parallel()
    for tp, pp, ep in ((1, 2, 2), (1, 1, 4), (2, 1, 4), (2, 2, 1)):
        groups = initialize_parallel(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
        _check_layout(groups, world_size, tp, pp, ep)
        destroy_parallel()


def _check_expert_layer_tp2_ep2(groups):
    """Tensor-parallel ranks hold the same tokens; each dispatches half of the capacity slots, the
    results are all-gathered back (DeepSpeed's gloo all-gather workaround), and after
    reduce_gradients every expert grad equals the single-process union-batch gradient."""
    import contextlib

    import torch
    from deepspeed.utils import groups as ds_groups

    from megatron_triroute.experts import TriRouteExperts
    from megatron_triroute.parallel import reduce_gradients

    d_model, num_experts = 8, 4

    @contextlib.contextmanager
    def no_tensor_parallel():  # the reference is one process: no TP token slicing
        saved, ds_groups.mpu = ds_groups.mpu, None
        try:
            yield
        finally:
            ds_groups.mpu = saved

    def replica_batch(replica):
        generator = torch.Generator().manual_seed(10 + replica)
        n = 6 + replica  # 6 and 7 tokens: odd no-drop capacities get padded to a multiple of tp
        index = torch.randint(-1, num_experts, (n, 2), generator=generator)
        index[0] = -1
        weight = torch.rand(n, 2, generator=generator)
        return torch.randn(n, d_model, generator=generator), index, weight, torch.randn(n, d_model, generator=generator)

    torch.manual_seed(5)
    layer = TriRouteExperts(d_model, 16, num_experts, groups)
    torch.manual_seed(5)
    reference = TriRouteExperts(d_model, 16, num_experts)

    x, index, weight, upstream = replica_batch(groups.dp_rank)
    x.requires_grad_(True)
    out = layer(x, index, weight)
    (out * upstream).sum(dim=1).mean().backward()  # this replica's mean loss L_r
    reduce_gradients(layer, groups)  # -> gradient of L = mean_r L_r

    with no_tensor_parallel():
        x_ref = x.detach().clone().requires_grad_(True)
        out_ref = reference(x_ref, index, weight)
        ((out_ref * upstream).sum(dim=1).mean() / groups.dp).backward()  # the union batch, one replica at a time
        torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(x.grad / groups.dp, x_ref.grad, rtol=0, atol=1e-6)
        other_x, other_index, other_weight, other_upstream = replica_batch(1 - groups.dp_rank)
        other_out = reference(other_x, other_index, other_weight)
        ((other_out * other_upstream).sum(dim=1).mean() / groups.dp).backward()

    union = dict(reference.experts.named_parameters())  # every expert, stacked
    first = groups.ep_rank * layer.num_local_experts
    for name, param in layer.experts.named_parameters():  # this rank's experts: the union's rows first..
        torch.testing.assert_close(param.grad, union[name].grad[first:first + layer.num_local_experts],
                                   rtol=0, atol=1e-6)


@pytest.mark.distributed
def test_two_process_layouts_match_megatron_and_deepspeed_and_pipeline_runs():
    run_distributed(_check_two_process_layouts, 2)


@pytest.mark.distributed
def test_tp2_ep2_on_four_processes_groups_and_expert_layer():
    run_distributed(_check_four_process_layouts, 4, timeout=180)


def test_validate_layout_accepts_valid_layouts():
    validate_layout(8, tp=2, pp=2, ep=2, num_experts=8, n_kv_heads=4)
    validate_layout(4, tp=2, ep=4, num_experts=4)  # expert groups may span tensor-parallel ranks
    validate_layout(1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=6, tp=2, n_kv_heads=3), "tensor_parallel=2 does not divide n_kv_heads=3; use tensor_parallel in {1, 3}"),
        (dict(world_size=6, tp=4), "world_size=6 is not divisible by tensor_parallel*pipeline_parallel=4"),
        (dict(world_size=6, tp=2, pp=2), "use tensor_parallel in {1, 3}"),
        (dict(world_size=4, pp=2, ep=4), "expert_parallel=4 does not divide the 2 ranks of a pipeline stage"),
        (dict(world_size=4, pp=2, ep=4), "use expert_parallel in {1, 2}"),
        (dict(world_size=8, ep=8, num_experts=6), "num_experts=6 is not divisible by expert_parallel=8; use expert_parallel in {1, 2}"),
        (dict(world_size=6, ep=4), "use expert_parallel in {1, 2, 3, 6}"),
        (dict(world_size=4, tp=0), "tensor_parallel=0 must be a positive integer"),
    ],
)
def test_validate_layout_errors_name_the_fix(kwargs, message):
    with pytest.raises(ParallelLayoutError) as error:
        validate_layout(**kwargs)
    assert message in str(error.value)


def test_initialize_parallel_requires_torch_distributed():
    # In a fresh interpreter: an earlier test in this process may have left torch.distributed initialised.
    import subprocess
    import sys

    code = (
        "import torch.distributed as dist\n"
        "from megatron_triroute.parallel.groups import initialize_parallel\n"
        "assert not dist.is_initialized()\n"
        "try:\n"
        "    initialize_parallel()\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
        "else:\n"
        "    raise SystemExit('initialize_parallel() did not raise')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "init_process_group" in done.stdout, done.stdout
