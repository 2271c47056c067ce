"""Generate text from a training checkpoint with the hard-decision inference engine.

    python -m megatron_triroute.generate --checkpoint RUN/checkpoints --prompt "Once upon a time" \
        [--prompts-file F] [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--json] [--data DIR] \
        [--calibrate] [--target-flops F] [--target-mem M]

The tokenizer and token tables come from the run's recorded data directory (`data.path` in the
checkpoint's config). Prints each prompt's continuation, the decode throughput, and the realised
FLOPs and KV-memory fractions of what was generated (executed attention-read and expert MACs over
the dense model's on the same tokens; KV bytes written over a dense 16-bit cache's). `--json`
prints one object: text, token_ids (a string and a list for one prompt, lists of them for several),
tokens_per_s, realised_flops, realised_mem.

A budget per request: `--target-flops F` / `--target-mem M` (fractions of the dense cost) serve
every prompt at that budget, and a `--prompts-file` ending in `.jsonl` holds one JSON object per
line, {"prompt": TEXT, "target_flops": F, "target_mem": M} (targets optional, defaulting to the
flags, then to the model's own). The engine meets them by per-request prices from the
checkpoint's price curve (inference/serve_budget.py; sampled first on the run's training batches
when the checkpoint has none, as `--calibrate` does); a target the routing cannot reach exits with
status 2 naming the reachable range. With targets, `--json` adds `requests`: per request its
targets and realised fractions over its generated tokens.

A budgeted TriRoute checkpoint written mid-run holds uncalibrated prices (the run calibrates them at
its end): generate says so on stderr, and `--calibrate` calibrates them first as the trainer does,
on the training batches trained last before the checkpoint's step (evaluation/calibration.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .command import no_grad_command


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_triroute.generate", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a run's checkpoint root (RUN/checkpoints) or one step_* directory")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompts-file", type=Path, help="one prompt per line; a .jsonl file: one JSON object per line "
                   "with prompt and optional target_flops, target_mem")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, help="the run's data directory, when its recorded data.path "
                   "(relative to where the run started) does not resolve from here")
    p.add_argument("--page-size", type=int, default=16, help="KV-cache slots per page")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--calibrate", action="store_true", help="calibrate the deployed prices on the run's training "
                   "batches before the checkpoint's step first (what the run does at its end)")
    p.add_argument("--target-flops", type=float, help="serve at this FLOPs fraction of dense (default: the model's own)")
    p.add_argument("--target-mem", type=float, help="serve at this KV-memory fraction of dense (default: the model's own)")
    args = p.parse_args(argv)
    args.targets = [(args.target_flops, args.target_mem)] * len(args.prompt)
    if args.prompts_file is not None:
        lines = [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
        if args.prompts_file.suffix == ".jsonl":
            from .inference.serve_budget import request_from_json

            for i, line in enumerate(lines, 1):
                prompt, targets = request_from_json(line, f"{args.prompts_file}:{i}", (args.target_flops, args.target_mem))
                args.prompt.append(prompt)
                args.targets.append(targets)
        else:
            args.prompt += lines
            args.targets += [(args.target_flops, args.target_mem)] * len(lines)
    if not args.prompt:
        p.error("give --prompt TEXT or --prompts-file FILE")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens={args.max_new_tokens}: must be >= 1")
    return args


def _main(argv=None) -> int:
    args = parse_args(argv)

    from .evaluation.calibration import serve_curve, serve_prices
    from .evaluation.loading import load_for_evaluation
    from .inference.engine import InferenceEngine, SamplingConfig
    from .vocab import decode_generated

    loaded = load_for_evaluation(args.checkpoint, args.data)
    serve_prices(loaded, args.calibrate, "pass --calibrate",
                 lambda message: print(f"warning: {message}", file=sys.stderr), args.page_size)
    curve = serve_curve(loaded, args.targets, lambda message: print(f"note: {message}", file=sys.stderr),
                        args.page_size)
    model, sp, eod = loaded.model, loaded.processor, loaded.eod

    engine = InferenceEngine(model, SamplingConfig(args.temperature, args.top_p, args.seed), args.page_size,
                             price_curve=curve)
    prompts = [sp.encode(text) or [eod] for text in args.prompt]
    start = time.perf_counter()
    done = engine.run(prompts, args.max_new_tokens, stop_token=eod, targets=args.targets)
    seconds = time.perf_counter() - start
    n_new = sum(len(r.generated) for r in done)
    ids = [[t for t in r.generated if t != eod] for r in done]
    texts = [decode_generated(sp, toks, eod) for toks in ids]
    result = {
        "text": texts[0] if len(texts) == 1 else texts,
        "token_ids": ids[0] if len(ids) == 1 else ids,
        "tokens_per_s": n_new / seconds if seconds > 0 else 0.0,
        "realised_flops": engine.audit.realised_flops(),
        "realised_mem": engine.audit.realised_mem(),
    }
    if curve is not None:
        result["requests"] = [{"target_flops": t[0], "target_mem": t[1], "realised_flops": f, "realised_mem": m,
                               "new_tokens": len(r.generated)}
                              for r, t, (f, m) in zip(done, args.targets, (engine.realised(r.rid) for r in done))]
    if args.json:
        print(json.dumps(result))
        return 0
    for prompt, text in zip(args.prompt, texts):
        print(f"{prompt}{text}\n")
    audit = engine.audit
    print(f"{n_new} tokens in {seconds:.2f} s ({result['tokens_per_s']:.1f} tokens/s, prefill included)")
    print(f"realised FLOPs {result['realised_flops']:.3f} of dense (attention reads + experts; projections "
          f"{audit.projection_macs / max(1, audit.budgeted_macs):.2f}x that, reported apart)")
    print(f"realised KV memory {result['realised_mem']:.3f} of a dense 16-bit cache")
    for i, req in enumerate(result.get("requests", [])):
        own = "the model's own"
        print(f"request {i}: target FLOPs {own if req['target_flops'] is None else req['target_flops']}, "
              f"KV memory {own if req['target_mem'] is None else req['target_mem']}; realised over its "
              f"{req['new_tokens']} generated tokens {req['realised_flops']:.3f}, {req['realised_mem']:.3f}")
    return 0


main = no_grad_command(_main)


if __name__ == "__main__":
    from megatron_triroute.process_exit import exit_process

    exit_process(main())
