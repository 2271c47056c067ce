"""The controller's overhead: its share of a model's parameters and of its FLOPs per token.

    python -m megatron_triroute.overhead --recipe 410m [key=value ...] [--seq-len N] [--layers N] [--json]

The measurement and what it counts: megatron_triroute/evaluation/overhead.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_triroute.overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", required=True, help="SCALE or SCALE-SYSTEM, e.g. tiny, 410m, 160m-moe")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. triroute.router.d_router=256")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the recipe's)")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers to build and scale from (default: all for small backbones, else one group)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)

    from .distributed.one_process import library_logs_to_stderr
    from .evaluation.overhead import format_table, overhead_report
    from .parallel import cpu_shim
    from .training.recipes import resolve

    try:  # configuration errors: one line and exit status 2, as the training CLI
        run = resolve(args.recipe, args.overrides)
        if args.seq_len is not None:
            run.triroute.model.seq_len = args.seq_len
        run.triroute.validate()
        if args.layers is not None and not 1 <= args.layers <= run.triroute.model.n_layers:
            raise ConfigError(f"--layers {args.layers}: must be in [1, n_layers={run.triroute.model.n_layers}]")
    except ValueError as err:  # ConfigError, or an unknown recipe
        print(f"error: {err}", file=sys.stderr)
        return 2
    with library_logs_to_stderr(), cpu_shim():  # DeepSpeed logs to stdout; keep stdout for the report
        report = overhead_report(run, args.layers)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    from megatron_triroute.process_exit import exit_process

    exit_process(main())
