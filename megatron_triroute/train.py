"""`python -m megatron_triroute.train --recipe NAME [key=value ...] [--dry-run | --plan --nodes N ...]`.

Launch with torchrun, deepspeed, srun or mpirun alike: rank, world size and rendezvous come from
`distributed.launch_env.resolve_launch_env`. Stop signals are handled from the first line, before
torch is imported, so a preemption notice during start-up is not fatal.
"""

from __future__ import annotations

from megatron_triroute.training import signals

signals.install_stop_handlers()

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from megatron_triroute.input_errors import reports_input_errors  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m megatron_triroute.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="tiny | 160m | 410m | 1p3b, optionally -SYSTEM (e.g. 410m-moe)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the recipe against the world size, print layout and memory estimate, exit")
    parser.add_argument("--world-size", type=int, default=None, help="with --dry-run: the world size to validate for")
    parser.add_argument("--plan", action="store_true",
                        help="list the layouts (TP, PP, EP, micro-batch, recompute) that fit a cluster, pick one, exit")
    parser.add_argument("--nodes", type=int, default=1, help="with --plan: nodes")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="with --plan: GPUs per node")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="with --plan: memory per GPU (GiB)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="with --plan: dense bf16 peak per GPU")
    parser.add_argument("--mfu", type=float, default=None,
                        help="with --plan: Dense's model FLOPs utilisation (default: measured, training.planner.DENSE_MFU)")
    parser.add_argument("--overrides-only", action="store_true",
                        help="with --plan: print only the picked layout's key=value overrides (for scripts)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. train.steps=100")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    for noisy in ("megatron", "deepspeed", "DeepSpeed"):  # per-file index logs drown the progress line
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = parse_args(argv)
    from megatron_triroute.process_exit import children_die_with_this_process

    children_die_with_this_process()  # no checkpoint writer outlives a killed rank
    from megatron_triroute.distributed.launch_env import export_torch_env, resolve_launch_env
    from megatron_triroute.training.recipes import resolve

    env = resolve_launch_env()
    run = resolve(args.recipe, args.overrides)
    if args.plan:
        from megatron_triroute.training.planner import Cluster, format_plan, on_gpus, plan

        cluster = Cluster(args.nodes, args.gpus_per_node, args.gpu_memory_gib, args.peak_tflops,
                          **({} if args.mfu is None else {"mfu": args.mfu}))
        run = on_gpus(run)
        candidates = plan(run, cluster)
        if args.overrides_only:
            if not candidates:
                print(f"error: no layout of {args.recipe} fits {args.nodes} x {args.gpus_per_node} GPUs of "
                      f"{args.gpu_memory_gib:g} GiB (see --plan without --overrides-only)", file=sys.stderr)
                return 2
            print(" ".join(candidates[0].overrides))
        else:
            print(format_plan(run, cluster, candidates))
        return 0
    if args.dry_run:
        from megatron_triroute.training.dry_run import dry_run

        return dry_run(run, args.world_size or env.world_size)
    from megatron_triroute.training.data import load_tables, pad_tables, padded_vocab

    tables = load_tables(run)
    run.triroute.model.vocab_size = padded_vocab(tables.log_prob.numel(), run.parallel.tensor)
    tables = pad_tables(tables, run.triroute.model.vocab_size)
    run.validate(env.world_size)
    export_torch_env(env)
    from megatron_triroute.parallel import cpu_shim
    from megatron_triroute.training import trainer

    with cpu_shim():  # Megatron-Core / DeepSpeed CPU workarounds, for the whole run (no-op with CUDA)
        return trainer.train(run, env, tables)


@reports_input_errors
def cli(argv=None) -> int:
    """main() with bad input (a config value, a recipe name, a checkpoint) reported as one line and
    exit status 2 (`input_errors.py`), and a run aborted for non-finite losses as one line and status 1."""
    try:
        return main(argv)
    except Exception as err:
        from megatron_triroute.training.trainer import NonFiniteLossError

        if not isinstance(err, NonFiniteLossError):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    status = cli()
    if status == signals.EXIT_REQUEUE:
        # The checkpoint is committed. Once one rank has exited 75, `srun --kill-on-bad-exit` sends
        # SIGTERM to the ranks still shutting down, and Python restores default handlers at shutdown
        # (ignored signals stay ignored): ignore the stop signals so every rank exits 75.
        import signal

        for signum in signals.STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
    from megatron_triroute.process_exit import exit_process

    exit_process(status)
