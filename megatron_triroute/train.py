"""`python -m megatron_triroute.train --recipe NAME [key=value ...] [--dry-run]`.

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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m megatron_triroute.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="tiny | 160m | 410m | 1p3b, optionally -SYSTEM (e.g. 410m-moe)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the recipe against the world size, print layout and memory estimate, exit")
    parser.add_argument("--world-size", type=int, default=None, help="with --dry-run: the world size to validate for")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. train.steps=100")
    return parser.parse_args(argv)


def resolve_run(args):
    from megatron_triroute.training.config import apply_overrides
    from megatron_triroute.training.recipes import get_recipe

    run = get_recipe(args.recipe)
    apply_overrides(run, args.overrides)
    return run


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    for noisy in ("megatron", "deepspeed", "DeepSpeed"):  # per-file index logs drown the progress line
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = parse_args(argv)
    from megatron_triroute.distributed.launch_env import export_torch_env, resolve_launch_env

    env = resolve_launch_env()
    run = resolve_run(args)
    if args.dry_run:
        from megatron_triroute.training.dry_run import dry_run

        return dry_run(run, args.world_size or env.world_size)
    from megatron_triroute.training.data import load_tables, padded_vocab

    tables = load_tables(run)
    vocab = padded_vocab(tables.log_prob.numel(), run.parallel.tensor)
    if vocab != tables.log_prob.numel():
        import torch

        from megatron_triroute.routing.side_features import TokenTables

        # Padding ids never occur in data; give them the rarest observed log-probability.
        pad = torch.full((vocab - tables.log_prob.numel(),), float(tables.log_prob.min()))
        tables = TokenTables(torch.cat([tables.log_prob, pad]),
                             torch.cat([tables.word_start, torch.zeros(pad.numel(), dtype=torch.bool)]), tables.eod_id)
    run.triroute.model.vocab_size = vocab
    run.validate(env.world_size)
    export_torch_env(env)
    from megatron_triroute.training import trainer

    return trainer.train(run, env, tables)


def cli(argv=None) -> int:
    """main() with configuration and input errors reported as one line and exit status 2."""
    from megatron_triroute.config import ConfigError

    try:
        return main(argv)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
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
    sys.exit(status)
