"""The lm-evaluation-harness command line with the `triroute` model registered.

    python -m megatron_triroute.lm_eval_harness run --model triroute \\
        --model_args checkpoint=RUN/checkpoints --tasks TASKS [--include_path DIR] [--output_path OUT] ...

Every argument is lm_eval's own (`lm-eval --help`); this only imports
`megatron_triroute.evaluation.harness` (which registers the model) before handing over to
`lm_eval`'s CLI, then prints the realised (FLOPs, KV-memory) fractions of what the engine ran
(also written into the results' `config.triroute_cost` with `--output_path`).
"""

from __future__ import annotations

import json

from .input_errors import reports_input_errors


@reports_input_errors
def main() -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as error:
        raise SystemExit(f"lm_eval is not installed ({error}). Fix: pip install -c constraints.txt -e '.[eval]'")
    from .evaluation import harness

    cli_evaluate()
    if harness.LAST_COST is not None:
        print("triroute realised cost (fractions of dense: attention-read + expert MACs; KV bytes written): "
              + json.dumps(harness.LAST_COST))
    return 0


if __name__ == "__main__":
    from megatron_triroute.process_exit import exit_process

    exit_process(main())
