"""Megatron-Core's distributed optimizer on CPU/gloo under the shim, as the library ships it (the
`megatron_distopt` engine, parallel/megatron_distopt.py, is built on this; its trainer-level tests
are in tests/training/test_dp_engine.py): its DDP reduce-scatters gradient buckets into each rank's shard, each rank
runs AdamW on its shard, the parameters are all-gathered, and after several steps every parameter
equals torch's AdamW run on the union of both ranks' batches with the same clip, within 1e-6."""

import pytest
import torch

from tests.dist_utils import run_distributed

STEPS = 3
LR, EPS, WD, CLIP = 1e-2, 1e-3, 0.1, 0.05  # CLIP below the gradient norm: every step clips


def _tiny_gpt():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return config, GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, None, labels=tokens).float().mean()


def _reference(model, world: int) -> dict[str, torch.Tensor]:
    """torch AdamW on one process: the mean over ranks of each rank's mean loss, the global-norm
    clip (coefficient clip / (norm + 1e-6), as Megatron's), no weight decay on 1-D parameters."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, eps=EPS)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(_loss(model, _batch(r, step)) for r in range(world)) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _distributed_optimizer_matches_adamw(rank, world):
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides

    from megatron_triroute.parallel import destroy_parallel, initialize_parallel

    initialize_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    config, model = _tiny_gpt()
    _, twin = _tiny_gpt()  # the same seed: the same initial weights (checked)
    initial = {n: p.detach().clone() for n, p in twin.named_parameters()}
    assert all(torch.equal(p.detach(), initial[n]) for n, p in model.named_parameters())
    expected = _reference(twin, world)
    # Small buckets: the ~60k gradients fall into several, each reduce-scattered on its own.
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, bucket_size=8000), model)
    config = OptimizerConfig(optimizer="adam", lr=LR, adam_eps=EPS, weight_decay=WD, clip_grad=CLIP,
                             use_distributed_optimizer=True)
    # The standard overrides: no weight decay on 1-D parameters and biases (ours: decay where dim >= 2).
    optimizer = get_megatron_optimizer(config, [ddp], config_overrides=get_standard_config_overrides(config))
    for group in optimizer.param_groups:  # what Megatron's OptimizerParamScheduler sets from the overrides
        group["weight_decay"] = WD * group["wd_mult"]
    assert sorted({g["weight_decay"] for g in optimizer.param_groups}) == [0.0, WD]
    shards = [p for group in optimizer.param_groups for p in group["params"]]
    assert 0 < sum(p.numel() for p in shards) < sum(p.numel() for p in model.parameters())  # this rank's part only
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        _loss(ddp, _batch(rank, step)).backward()
        ddp.finish_grad_sync()  # reduce-scatter: this rank's shard of the mean gradient
        ok, grad_norm, _ = optimizer.step()  # shard update, then the parameter all-gather
        assert ok and grad_norm > CLIP
    worst = max((p.detach() - expected[n]).abs().max().item() for n, p in model.named_parameters())
    assert worst <= 1e-6, worst
    assert all(not torch.equal(initial[n], expected[n]) for n in expected)  # every parameter moved
    destroy_parallel()


@pytest.mark.distributed
def test_megatron_distributed_optimizer_on_two_cpu_ranks_equals_adamw_on_the_union_batch():
    run_distributed(_distributed_optimizer_matches_adamw, 2, timeout=240)
