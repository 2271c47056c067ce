"""The CPU shim: a no-op where CUDA is available; on CPU every patched path runs inside it, everything is
restored on exit, and another library version is refused (checked in fresh processes)."""

import sys

import pytest
import torch

from megatron_triroute.parallel import cpu_shim
from megatron_triroute.parallel.cpu_compat import _WORKAROUNDS
from tests.dist_utils import run_distributed


def test_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = (torch.cuda.current_device, torch.cuda.synchronize, set(sys.modules))
    with cpu_shim() as applied:
        assert applied == ()
        assert (torch.cuda.current_device, torch.cuda.synchronize, set(sys.modules)) == before


def _check_patched_paths(rank, world_size):
    import deepspeed.comm as ds_comm
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.utils import GlobalMemoryBuffer

    from megatron_triroute.parallel import destroy_parallel, initialize_parallel

    # The libraries still need the workarounds (if these stop raising, a workaround can go).
    with pytest.raises((AssertionError, RuntimeError)):
        transformer_utils.get_default_causal_mask(4)
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    with pytest.raises(RuntimeError, match="cpu_shim"):  # refused outside the shim on CPU
        initialize_parallel()
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.optimizer import clip_grads, distrib_optimizer

    def patchable():
        return (torch.cuda.current_device, torch.cuda.synchronize, transformer_utils.torch,
                tensor_parallel.model_parallel_cuda_manual_seed, tensor_parallel.random.CudaRNGStatesTracker.fork,
                filesystem_async._get_write_results_queue, distrib_optimizer.DistributedOptimizer.__init__,
                clip_grads.clip_grad_by_total_norm_fp32, clip_grads.torch, torch.Tensor.type)

    originals = patchable()

    with cpu_shim() as applied:
        assert applied == tuple(w.__name__ for w in _WORKAROUNDS)
        with cpu_shim() as nested:
            assert nested == ()  # applied once; the inner exit restores nothing
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()
        # Names bound before the shim keep the original; look them up on the module.
        assert torch.equal(transformer_utils.get_default_causal_mask(3), torch.ones(3, 3).triu(1).bool())
        assert GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "scratch").device.type == "cpu"

        initialize_parallel()  # world of one; wraps gloo in DeepSpeed's comm backend without the JIT op
        assert ds_comm.comm.cdb.shm_comm_op is None
        flat = torch.empty(24)
        ds_comm.all_gather_into_tensor(flat, torch.arange(24.0).view(2, 3, 4))  # gloo: flat output buffer
        assert torch.equal(flat, torch.arange(24.0))

        # RNG tracker on the CPU generator: tracked streams are reproducible and leave the outer state alone.
        tensor_parallel.model_parallel_cuda_manual_seed(123)
        outer = torch.get_rng_state()
        tracker = tensor_parallel.get_cuda_rng_tracker()
        with tracker.fork():
            first = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), outer)
        with tracker.fork():
            second = torch.rand(3)
        assert not torch.equal(first, second)  # the tracked stream advanced
        tensor_parallel.model_parallel_cuda_manual_seed(123, force_reset_rng=True)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            assert torch.equal(torch.rand(3), first)
        torch.manual_seed(123)
        expected = torch.rand(2)
        tensor_parallel.model_parallel_cuda_manual_seed(123, force_reset_rng=True)
        assert torch.equal(torch.rand(2), expected)  # the data-parallel seed also seeds the CPU generator

        # A tiny GPT (RoPE, dropout, causal mask) through Megatron's schedule, twice from the same seed.
        def train_step():
            tensor_parallel.model_parallel_cuda_manual_seed(7, force_reset_rng=True)
            config = TransformerConfig(
                num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
                bias_dropout_fusion=False, persist_layer_norm=False, hidden_dropout=0.1, attention_dropout=0.1,
            )
            model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                             position_embedding_type="rope")
            tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
            positions = torch.arange(16).expand(2, 16)

            def forward_step(data_iterator, model):
                per_token = model(tokens, positions, None, labels=tokens)
                return per_token, lambda out: (out.float().mean(), {"loss": out.float().mean().detach()})

            losses = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
                seq_length=16, micro_batch_size=2, forward_only=False,
            )
            return model, losses[0]["loss"]

        model, loss = train_step()
        _, loss_again = train_step()
        assert torch.isfinite(loss) and torch.equal(loss, loss_again)  # dropout drew from the seeded tracker
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

        # A dist_checkpointing save collects its write results through a queue whose manager is
        # forked (a spawned one re-imports the whole program), and the tensors come back.
        import multiprocessing
        import tempfile

        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        saved = torch.arange(6.0).view(2, 3)
        with tempfile.TemporaryDirectory() as directory:
            dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", saved)}, directory,
                                    sharded_strategy=("torch_dist", 1))
            back = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 3))}, directory)
        assert torch.equal(back["w"], saved)
        managers = [p for p in multiprocessing.active_children() if "Manager" in p.name]
        assert managers and all(type(p).__name__ == "ForkProcess" for p in managers), managers
        assert filesystem_async._get_write_results_queue() is filesystem_async._get_write_results_queue()
        destroy_parallel()

    # Everything the shim replaced is back, and the CUDA-only paths fail again.
    assert all(a is b for a, b in zip(patchable(), originals))
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


def test_another_library_version_is_refused_before_anything_is_patched(monkeypatch):
    import megatron.core

    from megatron_triroute.parallel.cpu_compat import UnsupportedLibraryVersion

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    before = torch.cuda.current_device
    with pytest.raises(UnsupportedLibraryVersion, match=r"megatron\.core 0\.16\.1.*found.*0\.99\.0.*constraints\.txt"):
        with cpu_shim():
            pass
    assert torch.cuda.current_device is before


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="the workarounds are for machines without CUDA")
def test_patched_paths_run_on_cpu():
    run_distributed(_check_patched_paths, 1, cpu_shim=False)


def test_the_checkpoint_results_manager_dies_with_its_rank_and_frees_its_output():
    """A SIGKILLed rank's manager must not live on holding the rank's stdout (a launcher reading it,
    srun, would wait for the orphan) nor outlive it at all."""
    from tests.fork_check import assert_forks_die_with_their_process

    code = ("from megatron_triroute.parallel import cpu_compat\n"
            "queue = cpu_compat._forked_results_queue()\nqueue.put(1)\nassert queue.get() == 1\n"
            "print('ready', flush=True)\nimport time\ntime.sleep(600)\n")
    assert_forks_die_with_their_process(code, forks=1)  # the manager
