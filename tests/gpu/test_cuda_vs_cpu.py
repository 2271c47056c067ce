"""The CUDA path against the CPU path (skipped on CPU machines).

One process builds a tiny model (CPU initialisation, so both start from the same weights), moves it
to its device and runs, through `TrainEngine`: one training step (relaxed path, Megatron schedule,
gradient norm, clipping, optimizer, router statistics, budget), evaluation (the hard, priced
policy), and price calibration. The micro-batches are handed over on the CPU, as the trainer's data
loader makes them: the engine moves them. The same function runs once with CUDA hidden (the CPU
path, CPU workarounds applied) and once on the GPU under NCCL; fp32 on both (no TF32), so the
results agree to rounding.
"""

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute

pytestmark = pytest.mark.gpu

SYSTEMS = ("triroute", "dense", "moe")
LR = 1e-3


def _run(rank, world_size, device_name, out_path, system, local_attention="blocks", d_model=None):
    from megatron_triroute.systems import system_config
    from megatron_triroute.training.calibrate import calibrate_prices
    from megatron_triroute.training.engine import MicroBatch, TrainEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = system_config(system, tiny_triroute())
    if d_model is not None:
        cfg.model.d_model = d_model
    if device_name == "cuda":  # FlexAttention has no CPU backward: the CPU side keeps the blocks
        cfg.router.local_attention = local_attention
    cfg.validate()
    cfg.budget.flops_target, cfg.budget.mem_target = 0.6, 0.5
    model, groups = build(cfg)
    device = torch.device(device_name)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = TrainEngine(model, groups, optimizer, total_steps=4, clip_grad=1.0)
    batches = []
    for seed in range(2):
        tokens, labels, idx = batch(cfg, n=4, seed=seed, offset=4 * seed)
        batches.append(MicroBatch(tokens, labels, torch.ones(tokens.shape), idx))
    reports = [engine.train_step(batches, step) for step in range(2)]
    eval_loss, realised = engine.evaluate(batches)
    record = (calibrate_prices(model.budget, lambda prices: engine.evaluate(batches, prices)[1])
              if system == "triroute" else None)
    torch.save({
        "loss": [r.loss for r in reports], "grad_norm": [r.grad_norm for r in reports],
        "realised": [r.realised for r in reports], "lambdas": [r.lambdas for r in reports],
        "eval_loss": eval_loss, "eval_realised": realised,
        "prices": record["prices"] if record is not None else [0.0, 0.0],
        "calibrated": record is not None,
        "params": {k: v.detach().cpu() for k, v in model.state_dict().items() if torch.is_tensor(v)},
        "device": str(next(model.parameters()).device),
    }, out_path)


def _on(device: str, out_path, system: str, local_attention: str = "blocks", d_model: int | None = None) -> dict:
    if device == "cpu":
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the spawned child sees no GPU: the CPU path
        try:
            run_distributed(_run, 1, "cpu", str(out_path), system, "blocks", d_model, timeout=300)
        finally:
            if saved is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
    else:
        run_distributed(_run, 1, "cuda", str(out_path), system, local_attention, d_model, timeout=300, backend="nccl")
    return torch.load(out_path, weights_only=True)


@pytest.mark.parametrize("system, local_attention, d_model",
                         [(s, "blocks", None) for s in SYSTEMS] + [("triroute", "flex", 64), ("triroute", "blocks", 64)],
                         ids=[*SYSTEMS, "triroute-flex", "triroute-blocks-d_head16"])
def test_training_step_evaluation_and_calibration_agree_on_cuda_and_cpu(system, local_attention, d_model, tmp_path):
    """triroute with flex: FlexAttention's local mode on the GPU against the blockwise one on the CPU,
    at d_head 16 (its kernel's least); the blocks at d_head 16 too, the same comparison without flex."""
    cpu = _on("cpu", tmp_path / "cpu.pt", system, d_model=d_model)
    gpu = _on("cuda", tmp_path / "gpu.pt", system, local_attention, d_model)
    assert cpu["device"] == "cpu" and gpu["device"].startswith("cuda")
    for key in ("loss", "grad_norm", "eval_loss"):
        assert gpu[key] == pytest.approx(cpu[key], rel=1e-4, abs=1e-6), key
    for key in ("realised", "lambdas", "eval_realised"):
        assert torch.tensor(gpu[key]).double() == pytest.approx(torch.tensor(cpu[key]).double(), abs=2e-3), key
    # bisection on a piecewise-constant realised cost: a decision at a tie may move the bracket
    assert torch.tensor(gpu["prices"]) == pytest.approx(torch.tensor(cpu["prices"]), rel=0.05, abs=0.02)
    assert gpu["params"].keys() == cpu["params"].keys()
    # AdamW (lr 1e-3) moves an element by about lr whatever its gradient's size, so where a gradient
    # is near zero (near eps, or within its sum's rounding) each device's rounding sets the step:
    # parameters agree within 5 % of one step (a wrong gradient moves them by whole steps)
    for name, value in cpu["params"].items():
        torch.testing.assert_close(gpu["params"][name].to(value.dtype), value, rtol=1e-4, atol=0.05 * LR,
                                   msg=lambda detail, name=name: f"{name}: {detail}")
