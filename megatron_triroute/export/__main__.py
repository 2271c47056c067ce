"""Export a training checkpoint to a Hugging Face directory, or import one back.

    python -m megatron_triroute.export --checkpoint RUN/checkpoints --output HF_DIR \
        [--dtype fp32|bf16|fp16] [--max-shard-size 5GB] [--data DATA_DIR] [--no-native] [--calibrate] [--price-curve]
    python -m megatron_triroute.export --import HF_DIR --output CKPT_DIR

A checkpoint written at any tensor/pipeline/expert layout is read whole in this process. Before
anything is written the export checks that every tensor is present exactly once with its shape;
the directory is written under a temporary name and renamed when complete. Dense checkpoints
export as native LlamaForCausalLM (no remote code) unless --no-native. config.json records the
prices record (inference/prices.py): whether the deployed prices were calibrated. A budgeted
TriRoute checkpoint written mid-run has uncalibrated prices (the run calibrates them at its end):
the export warns, and `--calibrate` calibrates them first, as the trainer does, on the training
batches trained last before the checkpoint's step, and exports those. `--price-curve` adds the
price curve (inference/serve_budget.py) to the record, so the exported model serves per-request
budgets: `generate(..., target_flops=F, target_mem=M)`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..input_errors import reports_input_errors


class _Stderr(logging.StreamHandler):
    """Progress lines to whatever sys.stderr is at the time of writing."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_triroute.export", description=__doc__.split("\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="a run's checkpoint root (RUN/checkpoints) or one step_* dir")
    source.add_argument("--import", dest="import_dir", type=Path, help="an exported Hugging Face directory to "
                        "convert back into a training checkpoint")
    p.add_argument("--output", type=Path, required=True, help="the directory to create (must not exist)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="weight storage dtype")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB")
    p.add_argument("--data", type=Path, help="the run's data directory (tokenizer), when its recorded data.path "
                   "does not resolve from here")
    p.add_argument("--no-native", action="store_true", help="export Dense as TriRoute remote code, not Llama")
    p.add_argument("--calibrate", action="store_true", help="calibrate the deployed prices on the run's training "
                   "batches before the checkpoint's step first and export those (loads the model twice)")
    p.add_argument("--price-curve", action="store_true", help="put the price curve in config.json (sampled on the "
                   "run's training batches when the checkpoint has none): generate(target_flops=, target_mem=)")
    return p.parse_args(argv)


@reports_input_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    log = logging.getLogger("megatron_triroute.export")
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("[export] %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    from .safetensors_io import parse_size

    if args.import_dir is not None:
        from .importer import import_hf

        path = import_hf(args.import_dir, args.output)
    else:
        from .exporter import export

        path = export(args.checkpoint, args.output, args.dtype, parse_size(args.max_shard_size), args.data,
                      native=not args.no_native, calibrate=args.calibrate, price_curve=args.price_curve)
    print(path)
    return 0


def cli() -> None:
    from megatron_triroute.process_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    from megatron_triroute.process_exit import exit_process

    exit_process(main())
