"""Data-parallel bytes per rank per step and communication vs compute time, from the config alone
(the arithmetic of docs/parallelism.md, "Data-parallel communication at scale").

    python benchmarks/estimate_dp_comm.py [--recipe 1p3b] [--nodes 8] [--gpus-per-node 8]
                                          [--mfu 0.35] [--peak-tflops 989] [key=value ...]

Parameters per rank (dense and expert) come from `planner.estimate_rank_memory` and the expert
width of `routing.cost.expert_width`; group sizes from the layout (dense over DP, experts over EDP).
Per step, with n the group size and P its parameters on one rank (ring algorithms):
  all-reduce 2 (n-1)/n x bytes; reduce-scatter and all-gather (n-1)/n x bytes each; a ZeRO-1
  broadcast of each owner's updated parameters moves (n-1)/n x 4P per rank summed over the owners
  (each rank forwards every message but the last hop's, like an all-gather).
Time model: a ring crosses each node boundary once, so a group with g ranks on each node puts one
rank's bytes on the node's network, and gpus_per_node / g such groups share that network at once
(data-parallel groups are the outer dimension: they span every node). Time = bytes sent per rank x
gpus_per_node / g / node bandwidth (NVLink inside the node is faster and not counted). Compute: 6 x
active parameters (dense + top_k/num_experts of the experts) x tokens per step / (GPUs x peak x MFU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_triroute.routing.cost import expert_width  # noqa: E402
from megatron_triroute.training.planner import estimate_rank_memory  # noqa: E402
from megatron_triroute.training.recipes import resolve  # noqa: E402

BANDWIDTHS = {"400 Gb/s": 400e9 / 8, "3.2 Tb/s": 3.2e12 / 8}
"""Inter-node bandwidth per node, bytes/s."""


SCHEMES = {  # name: (formula, grad bytes factor x (n-1)/n, param bytes factor x (n-1)/n, overlap grads, overlap params)
    "before: fp32 all-reduce + ZeRO-1 fp32 broadcasts": ("2(n-1)/n x 4 + (n-1)/n x 4", 8, 4, False, False),
    "megatron DDP (retired): same, all-reduce overlapped": ("2(n-1)/n x 4 + (n-1)/n x 4", 8, 4, True, False),
    "replicated, grad_reduce_dtype=bf16 (retired)": ("2(n-1)/n x 2 + (n-1)/n x 4", 4, 4, False, False),
    "megatron_distopt, fp32 run (the engine): fp32 grads + params, overlap": ("(n-1)/n x 4 + (n-1)/n x 4", 4, 4, True, True),
    "dist. optimizer, fp32 grads, bf16 params, overlap": ("(n-1)/n x 4 + (n-1)/n x 2", 4, 2, True, True),
    "megatron_distopt, bf16 run (the engine): bf16 grads + params, overlap": ("(n-1)/n x 2 + (n-1)/n x 2", 2, 2, True, True),
}
"""The bf16 rows count every parameter at 2 bytes; the engine's bf16 option keeps the routers and 1-D gains
fp32 (0.2 % of the 1p3b recipe's parameters). Gradients overlap the backward (2/3 of the compute) with overlap_grad_reduce; parameters overlap
the next forward (1/3) only with the distributed optimizer's overlap_param_gather (ZeRO-1's
broadcasts follow the optimizer step and are exposed)."""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="1p3b")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100 SXM)")
    parser.add_argument("--mfu", type=float, default=0.35, help="achievable fraction of the peak (the planner's)")
    args = parser.parse_args(argv)
    run = resolve(args.recipe, args.overrides)
    world = args.nodes * args.gpus_per_node
    run.validate(world)
    m, r, p = run.triroute.model, run.triroute.router, run.parallel
    dp = world // (p.tensor * p.pipeline)
    edp = dp * p.tensor // p.expert
    per_rank = estimate_rank_memory(run, world)["parameters_per_rank"]
    layers = m.n_layers // p.pipeline
    expert_all = m.n_layers * r.num_experts * 3 * m.d_model * expert_width(m, r) if r.expert_routing else 0.0
    expert = layers * expert_all / m.n_layers / p.expert
    dense = per_rank - expert
    tokens = run.train.global_batch_size * m.seq_len
    dense_total = dense * p.tensor * p.pipeline  # the whole model's dense parameters (the embedding counted once per copy)
    active = dense_total + expert_all * r.top_k / r.num_experts
    compute_s = 6 * active * tokens / (world * args.peak_tflops * 1e12 * args.mfu)
    print(f"recipe {run.name}: {args.nodes} nodes x {args.gpus_per_node} GPUs, layout tensor {p.tensor} x pipeline "
          f"{p.pipeline} x data {dp}, expert {p.expert} (expert-data {edp})")
    print(f"parameters per rank {per_rank / 1e9:.3f} B = dense {dense / 1e9:.3f} B (group: DP, n={dp}) + "
          f"expert {expert / 1e9:.3f} B (group: EDP, n={edp})")
    print(f"compute: 6 x {active / 1e9:.3f} B active parameters x {tokens:,} tokens / ({world} GPUs x "
          f"{args.peak_tflops:g} TFLOP/s x MFU {args.mfu:g}) = {compute_s:.3f} s per step")
    out = {"per_rank": per_rank, "dense": dense, "expert": expert, "dp": dp, "edp": edp, "compute_s": compute_s, "rows": {}}
    share = {n: args.gpus_per_node / max(1, n // min(n, args.nodes)) for n in (dp, edp)}  # groups per node network
    print(f"groups sharing a node's network: dense {share[dp]:g}, expert {share[edp]:g}")
    ring = {n: (n - 1) / n for n in (dp, edp)}
    for name, (formula, grad_b, param_b, overlap_grads, overlap_params) in SCHEMES.items():
        grads = grad_b * (dense * ring[dp] + expert * ring[edp])
        params = param_b * (dense * ring[dp] + expert * ring[edp])
        grads_net = grad_b * (dense * ring[dp] * share[dp] + expert * ring[edp] * share[edp])
        params_net = param_b * (dense * ring[dp] * share[dp] + expert * ring[edp] * share[edp])
        row = {"bytes": grads + params}
        cells = []
        for bw, rate in BANDWIDTHS.items():
            t_grads, t_params = grads_net / rate, params_net / rate
            exposed = (max(0.0, t_grads - 2 / 3 * compute_s) if overlap_grads else t_grads) + \
                      (max(0.0, t_params - 1 / 3 * compute_s) if overlap_params else t_params)
            row[bw] = {"comm_s": t_grads + t_params, "exposed_s": exposed, "step_s": compute_s + exposed}
            cells.append(f"{bw}: comm {t_grads + t_params:5.2f} s, exposed {exposed:5.2f} s, step {compute_s + exposed:5.2f} s")
        out["rows"][name] = row
        print(f"  {name:<55} {formula:<27} {(grads + params) / 1e9:6.2f} GB/rank  " + " | ".join(cells))
    return out


if __name__ == "__main__":
    main()
