"""Megatron-Core's distributed optimizer on CPU/gloo under the shim, as the library ships it (the
`megatron_distopt` engine, parallel/megatron_distopt.py, is built on this; its trainer-level tests
are in tests/training/test_dp_engine.py): its DDP reduce-scatters gradient buckets into each rank's shard, each rank
runs AdamW on its shard, the parameters are all-gathered, and after several steps every parameter
equals torch's AdamW run on the union of both ranks' batches with the same clip, within 1e-6."""

import math

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


BF16_STEPS = 2


def _hand_gradient(param: torch.Tensor, index: int, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * index + rank)
    return (torch.randn(param.shape, generator=g) * 1e-2).to(param.dtype)  # as this rank's buffer holds it


def _hand_bf16_reference(named: list[tuple[str, torch.Tensor]], dtypes: dict[str, torch.dtype], world: int,
                         sum_in_bf16: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """By hand: each rank's gradient pre-scaled by 1/world in its buffer's dtype and summed over
    ranks (in bf16 for bf16 buffers: each addition rounded to bf16, or, with `sum_in_bf16=False`,
    exactly in fp32), the global-norm clip, torch AdamW on fp32 masters (a bf16 parameter's
    master starts at its bf16 value). Returns the masters and the norm of each step."""
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in named}
    adamw = torch.optim.AdamW([{"params": [masters[n] for n, p in named if p.dim() >= 2], "weight_decay": WD},
                               {"params": [masters[n] for n, p in named if p.dim() < 2], "weight_decay": 0.0}],
                              lr=LR, eps=EPS)
    norms = []
    for step in range(BF16_STEPS):
        reduced = {}
        for i, (n, p) in enumerate(named):
            parts = [_hand_gradient(torch.empty(p.shape, dtype=dtypes[n]), i, r, step) * (1.0 / world)
                     for r in range(world)]
            total = parts[0] if sum_in_bf16 else parts[0].float()
            for part in parts[1:]:
                total = total + (part if sum_in_bf16 else part.float())
            reduced[n] = total.float()
        norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in reduced.values()))
        scale = CLIP / (norm + 1e-6) if norm > CLIP else 1.0
        for n, _ in named:
            masters[n].grad = reduced[n] * scale
        adamw.step()
        norms.append(norm)
    return {n: m.detach() for n, m in masters.items()}, norms


def _bf16_engine(seed: int = 3):
    from megatron_triroute.parallel.megatron_distopt import MegatronDistributedAdamW
    from tests.model.harness import build, tiny_triroute

    model, groups = build(tiny_triroute(), seed=seed)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [{"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": WD},
             {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0}]
    engine = MegatronDistributedAdamW(model, decay, groups, lr=LR, betas=(0.9, 0.999), eps=EPS,
                                      overlap_grad_reduce=False, bucket_size=4000, bf16=True)
    return model, engine


def _bf16_engine_matches_hand_reference(rank, world, directory):
    from megatron_triroute.checkpoint import CheckpointError
    from megatron_triroute.checkpoint.sharded import load_model, save_model, save_state
    from megatron_triroute.parallel import destroy_parallel
    from megatron_triroute.parallel.megatron_distopt import low_precision_parameters

    model, engine = _bf16_engine()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    low = {n for n, _ in low_precision_parameters(model)}
    dtypes = {n: p.dtype for n, p in named}
    assert {n for n, d in dtypes.items() if d == torch.bfloat16} == low and len(low) > 0
    assert any("controller" in n for n in dtypes) and all(dtypes[n] == torch.float32 for n in dtypes if "controller" in n)
    assert "gradients in bfloat16+float32" in engine.describe()
    initial = {n: p.detach().clone() for n, p in named}
    expected, norms = _hand_bf16_reference([(n, initial[n]) for n, _ in named], dtypes, world, sum_in_bf16=True)
    fp32_sum, _ = _hand_bf16_reference([(n, initial[n]) for n, _ in named], dtypes, world, sum_in_bf16=False)
    for step in range(BF16_STEPS):
        engine.begin()
        for i, (_, p) in enumerate(named):
            p.main_grad.copy_(_hand_gradient(p, i, rank, step))  # what this rank's backward would have left
        engine.finish()  # the bf16 buckets reduce-scattered in bf16
        norm = engine.grad_norm()
        assert norm == pytest.approx(norms[step], rel=1e-6) and norm > CLIP
        engine.clip(norm, CLIP)
        engine.step()  # AdamW on the fp32 master shards, then the bf16 all-gather
    masters = engine.master_parameters()
    assert set(masters) == {id(p) for n, p in named if n in low}
    worst = 0.0
    for n, p in named:
        master = masters[id(p)] if n in low else p.detach()
        assert master.dtype == torch.float32
        worst = max(worst, (master - expected[n]).abs().max().item())
        if n in low:  # the parameter is its master's rounding, from whichever rank stepped it
            assert torch.equal(p.detach(), master.to(torch.bfloat16)), n
    assert worst <= 1e-6, worst
    # the hand reference can tell: summing in fp32 instead moves the masters by far more
    assert max((fp32_sum[n] - expected[n]).abs().max().item() for n in low) > 1e-5

    # A checkpoint stores the masters; loading it (as train.init_from does) restores them exactly.
    with pytest.raises(CheckpointError, match="would be stored in low precision"):
        save_model(directory, model)  # without the optimizer that holds the masters
    save_state(directory, model, engine)
    destroy_parallel()
    fresh, fresh_engine = _bf16_engine(seed=4)
    assert any(not torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    load_model(directory, fresh, fresh_engine)
    restored = fresh_engine.master_parameters()
    by_name = dict(fresh.named_parameters())
    for n, p in named:
        if n in low:
            assert torch.equal(restored[id(by_name[n])], masters[id(p)]), n
        assert torch.equal(by_name[n].detach(), p.detach()), n
    destroy_parallel()


@pytest.mark.distributed
def test_bf16_parameters_reduce_in_bf16_and_step_fp32_masters(tmp_path):
    """`MegatronDistributedAdamW(bf16=True)` on two gloo ranks, with gradients written by hand
    into Megatron's buffers: the backbone's and experts' matrices are bf16 parameters (the
    routers' and the 1-D gains fp32), each bf16 bucket is reduce-scattered in bf16, the norm and
    clip read the fp32 master shards, AdamW steps the masters, and every bf16 parameter is its
    master's rounding. Two steps equal the hand computation within 1e-6 (the masters gathered by
    `master_parameters`, what checkpoints store); a checkpoint written from them loads them back
    exactly into a fresh engine (`load_model` with the optimizer: the `train.init_from` path)."""
    run_distributed(_bf16_engine_matches_hand_reference, 2, str(tmp_path / "ckpt"), timeout=240)


def _adamw_pair():
    """Two torch AdamW over equal parameters (two groups, decay on matrices only)."""
    torch.manual_seed(0)
    shapes = [(5, 7), (7,), (3, 5), (3,)]
    values = [torch.randn(s) for s in shapes]
    pair = []
    for _ in range(2):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        pair.append((params, torch.optim.AdamW([{"params": params[0::2], "weight_decay": WD},
                                                {"params": params[1::2], "weight_decay": 0.0}], lr=LR, eps=EPS)))
    return pair


def test_cpu_adamw_is_fused_and_steps_as_torchs_adamw():
    from megatron_triroute.parallel.megatron_distopt import fuse_adamw
    from tests.benchmarks import load_benchmark

    (plain_params, plain), (fused_params, fused) = _adamw_pair()
    assert fuse_adamw(fused)
    assert all(g["fused"] for g in fused.param_groups) and not any(g["fused"] for g in plain.param_groups)
    counter = load_benchmark("op_counter").StepCounter()
    for step in range(STEPS):
        for params in (plain_params, fused_params):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
        plain.step()
        if step == STEPS - 1:
            with counter:
                fused.step()
        else:
            fused.step()
    for a, b in zip(plain_params, fused_params):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert any(not torch.equal(a, v) for a, v in zip(plain_params, _adamw_pair()[0][0]))  # they moved
    # one fused kernel per group, no host read of a step count (torch's CPU default: one per tensor)
    assert counter.host_syncs == 0 and counter.ops <= 6, (counter.ops, counter.syncs)


def test_fuse_adamw_leaves_other_optimizers_alone():
    from megatron_triroute.parallel.megatron_distopt import fuse_adamw

    param = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([param], lr=0.1)
    assert not fuse_adamw(sgd) and not sgd.param_groups[0].get("fused")
    foreach = torch.optim.AdamW([param], lr=0.1, foreach=True)
    assert not fuse_adamw(foreach) and foreach.param_groups[0]["foreach"]


def test_fp32_shards_are_their_buffer_slots_so_the_copies_are_skipped():
    """Megatron's copy of the updated fp32 shards into the parameter buffer writes each value onto
    itself: the skip dispatches nothing, a step leaves the parameters as Megatron's copy would, and a
    shard that is not its slot brings Megatron's copy back. The shards' gradients are the slices
    of the gradient buffer Megatron's own copy sets, kept from step to step while they still are."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_triroute.distributed.one_process import single_process_parallel
    from megatron_triroute.parallel.megatron_distopt import skip_aliased_param_copy
    from tests.benchmarks import load_benchmark

    with single_process_parallel("gloo"):
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(7)
        config, model = _tiny_gpt()
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
        chained = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, use_distributed_optimizer=True), [ddp])
        opt = next(o for o in getattr(chained, "chained_optimizers", [chained]) if isinstance(o, DistributedOptimizer))
        assert skip_aliased_param_copy(opt)
        _loss(ddp, _batch(0, 0)).backward()
        ddp.finish_grad_sync()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        counter = load_benchmark("op_counter").StepCounter()
        with counter:
            ok, _, _ = chained.step()
        assert ok
        shards = [(p, shard) for mg, sg in zip(opt.model_fp32_groups, opt.shard_fp32_groups) for p, shard in zip(mg, sg)]
        kept = [shard.grad for _, shard in shards]
        DistributedOptimizer._copy_model_grads_to_main_grads(opt)  # Megatron's own: the same slices
        assert all(shard.grad.data_ptr() == g.data_ptr() and torch.equal(shard.grad, g) for (_, shard), g in zip(shards, kept))
        assert all(g.untyped_storage().data_ptr() == p.main_grad.untyped_storage().data_ptr() for (p, _), g in zip(shards, kept))
        counter = load_benchmark("op_counter").StepCounter()
        with counter:
            opt._copy_model_grads_to_main_grads()
        assert counter.ops == 0 and all(shard.grad is g for (_, shard), g in zip(shards, kept))
        param, shard = shards[0]
        param.main_grad = param.main_grad.clone().fill_(0.25)  # a new gradient buffer: its slice is taken
        opt._copy_model_grads_to_main_grads()
        assert bool((shard.grad == 0.25).all()) and all(s.grad is g for (_, s), g in zip(shards[1:], kept[1:]))
        stepped = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert all(not torch.equal(before[n], stepped[n]) for n in before)  # AdamW moved every parameter
        counter = load_benchmark("op_counter").StepCounter()
        with counter:
            opt._copy_main_params_to_model_params()
        assert counter.ops == 0
        DistributedOptimizer._copy_main_params_to_model_params(opt)  # Megatron's copy changes nothing
        assert all(torch.equal(p.detach(), stepped[n]) for n, p in model.named_parameters())
        # a shard held apart from its slot: Megatron's copy runs and writes it into the parameter
        group = next(g for g in opt.shard_fp32_groups if g)
        group[0] = group[0].detach().clone().fill_(0.5)
        opt._copy_main_params_to_model_params()
        assert any(bool((p.detach() == 0.5).all()) for p in model.parameters())


def test_a_world_of_one_skips_its_identity_collectives_and_steps_the_same(monkeypatch):
    """In a data-parallel group of one the shard is the bucket: the gradient reduce-scatter and the
    parameter all-gather are the identity. With the skip they are not called at all, and two steps
    (gradient reduction overlapped with the backward, so the asynchronous path's wait runs too)
    leave every parameter bit for bit where the same steps through the collectives leave it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer as buffers
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_triroute.distributed.one_process import single_process_parallel
    from megatron_triroute.parallel.megatron_ddp import skip_world_of_one_collectives

    calls = {"dist_all_gather_func": 0, "dist_reduce_scatter_func": 0}

    def counted(name):
        collective = getattr(buffers, name)
        collective = getattr(collective, "__wrapped__", collective)  # under the skip, if applied already

        def call(*args, **kwargs):
            calls[name] += 1
            return collective(*args, **kwargs)
        return call

    for name in calls:
        monkeypatch.setattr(buffers, name, counted(name))

    def two_steps() -> dict[str, torch.Tensor]:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(7)
        config, model = _tiny_gpt()
        start.update({n: p.detach().clone() for n, p in model.named_parameters()})
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=True), model)
        chained = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, use_distributed_optimizer=True),
                                         [ddp])
        for step in range(2):
            ddp.zero_grad_buffer()
            chained.zero_grad()
            _loss(ddp, _batch(0, step)).backward()
            ddp.finish_grad_sync()
            assert chained.step()[0]
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    start: dict[str, torch.Tensor] = {}
    with single_process_parallel("gloo"):
        through = two_steps()
        assert all(n > 0 for n in calls.values()), calls
        seen = dict(calls)
        assert skip_world_of_one_collectives()
        skipped = two_steps()
        assert calls == seen, calls  # not one call more
    assert through.keys() == skipped.keys()
    assert all(torch.equal(through[n], skipped[n]) for n in through)
    assert all(not torch.equal(through[n], start[n]) for n in through)  # every parameter stepped
