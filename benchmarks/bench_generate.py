"""End to end, as a user runs it: TriRoute's `generate` (the inference engine: prefill, then decode)
against the Dense model exported to Hugging Face and run by transformers' own `generate`.

    python benchmarks/bench_generate.py [--shape 160m] [--prompt-tokens 512] [--new-tokens 32]
        [--repeats 5] [--threads 1] [--budgets 0.35,0.25 1,1] [--json] [--quick]

Models (float32, one fixed thread count, one request):
- **Dense on transformers**: `transformers.LlamaForCausalLM` built from the config the Dense exporter
  writes for this shape (`export.llama.llama_config`: Dense exports as a native Llama), random
  weights, its default attention (SDPA) and cache; `generate(do_sample=False)` with exactly
  `--new-tokens` tokens (no end-of-sequence stop).
- **TriRoute**: `inference.InferenceEngine.run` (what `python -m megatron_triroute.generate` calls:
  batched prefill, then one decode step per token, the cost audit on) on the same SYNTHETIC shape with
  random weights. Every layer runs its real controller and its decisions are replaced by FORCED
  ones in exact proportions (`forced_decisions.budget_mix` at the final context: the mix whose
  hard cost is the budget's, FLOPs 0.55 and KV memory 0.40 of Dense's), for the prompt's tokens as
  for the generated ones. The engine's audit reports what was executed (`realised_fractions`).

Protocol. One warm-up run of each, then `--repeats` rounds, each timing (A B A B) the whole
generation of both (prompt + `--new-tokens` tokens) and then the prompt alone (`--new-tokens 1`:
prefill and the first token). Per figure the median and interquartile range over the rounds, and
the median of the per-round ratios TriRoute / transformers (below 1: TriRoute is faster). Decode
time per token = (whole - prompt alone) / (new tokens - 1).

Random weights make the text meaningless and do not change the work: both models run every
token's full computation (TriRoute the forced decisions' share of it).

The serve-time dial (`--budgets F,M ...`): the same TriRoute model generates once more per (FLOPs,
KV memory) target, its decisions forced to `budget_mix` at that target, in the same interleaved
rounds; `budget_dial` gives per target its whole, prompt-alone and per-token ratios against
transformers and its realised fractions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.bench_decode import at_budget, budget_name, build_routed, parse_budgets, spread  # noqa: E402
from benchmarks.forced_decisions import budget_mix, force  # noqa: E402
from megatron_triroute.config import TriRouteConfig  # noqa: E402
from megatron_triroute.systems import system_config  # noqa: E402


def build_llama(config: TriRouteConfig):
    """transformers' LlamaForCausalLM with the config the Dense exporter writes for this shape."""
    import transformers

    from megatron_triroute.export.llama import llama_config

    cfg = llama_config(config, eod=0, tree={"training_step": 0})
    for key in ("triroute", "training_config", "training_step", "prices", "eod_token_id"):
        cfg.pop(key)
    cfg.update(eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()


class Runs:
    """One generation of each model: `triroute(prompt, n)` and `hf(prompt, n)` return (seconds, tokens);
    `run(name, prompt, n)` also takes a dial's TriRoute (`dial`: (FLOPs, memory) target -> forced mix,
    the same model, named `budget_name(target)`)."""

    def __init__(self, config: TriRouteConfig, mix: dict, dial: dict | None = None):
        self.config, self.mix = config, mix
        self.targets = {budget_name(*target): target for target in dial or {}}
        self.mixes = {"triroute": mix} | {budget_name(*target): m for target, m in (dial or {}).items()}
        self.model = build_routed(config)
        self.llama = build_llama(config)
        self.realised_by: dict[str, dict] = {}  # each TriRoute's realised fractions, of its last generation

    def run(self, name: str, prompt: list[int], new: int) -> tuple[float, list[int]]:
        return self.hf(prompt, new) if name == "hf" else self.triroute(prompt, new, name)

    def triroute(self, prompt: list[int], new: int, name: str = "triroute") -> tuple[float, list[int]]:
        from megatron_triroute.inference.engine import InferenceEngine

        force(self.model, self.mixes[name], new, 1, [len(prompt)] + [1] * (new - 1))
        start = time.perf_counter()
        engine = InferenceEngine(self.model)
        (request,) = engine.run([prompt], new)
        seconds = time.perf_counter() - start
        self.realised_by[name] = {"flops": engine.audit.realised_flops(), "mem": engine.audit.realised_mem()}
        return seconds, request.generated

    @torch.no_grad()
    def hf(self, prompt: list[int], new: int) -> tuple[float, list[int]]:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        out = self.llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False)
        seconds = time.perf_counter() - start
        return seconds, out[0, len(prompt):].tolist()


def measure(runs: Runs, prompt: list[int], new: int, repeats: int, log) -> dict:
    """The interleaved rounds (module doc); every figure is computed from the returned lists."""
    names = ["triroute", "hf", *runs.targets]
    for name in names:  # warm-up
        runs.run(name, prompt, new)
    times = {f"{name}_{label}": [] for label in ("whole", "prompt") for name in names}
    counts = set()
    for r in range(repeats):
        for label, n in (("whole", new), ("prompt", 1)):
            for name in names:
                seconds, tokens = runs.run(name, prompt, n)
                times[f"{name}_{label}"].append(seconds)
                counts.add((name, n, len(tokens)))
        log(f"round {r + 1}/{repeats}: whole TriRoute {times['triroute_whole'][-1]:.3f} s, transformers "
            f"{times['hf_whole'][-1]:.3f} s; prompt alone {times['triroute_prompt'][-1]:.3f} s, "
            f"{times['hf_prompt'][-1]:.3f} s")
    out = {"seconds": {k: spread(v) for k, v in times.items()}, "seconds_runs": times,
           "decode_seconds_per_token": {k: spread(per_token(times, k, new)) for k in ("triroute", "hf")},
           "tokens_generated": [list(c) for c in sorted(counts)]}
    out |= ratios_to_hf(times, "triroute", new)
    out["realised_fractions"] = runs.realised_by["triroute"]
    if runs.targets:  # the dial: each target's TriRoute against transformers in the same rounds
        out["budget_dial"] = [{"system": name, "flops_target": flops, "mem_target": mem,
                               "realised_fractions": runs.realised_by[name]} | ratios_to_hf(times, name, new)
                              for name, (flops, mem) in runs.targets.items()]
    return out


def per_token(times: dict, name: str, new: int) -> list[float]:
    """Per round, `name`'s seconds per decoded token: (whole - prompt alone) / (new tokens - 1)."""
    return [(w - p) / max(new - 1, 1) for w, p in zip(times[f"{name}_whole"], times[f"{name}_prompt"])]


def ratios_to_hf(times: dict, name: str, new: int) -> dict:
    """`name`'s whole generation, prompt alone and decoded token against transformers': the spread of
    the per-round ratios."""
    out = {f"{label}_ratio": spread([a / b for a, b in zip(times[f"{name}_{label}"], times[f"hf_{label}"])])
           for label in ("whole", "prompt")}
    out["decode_ratio"] = spread([a / b for a, b in zip(per_token(times, name, new), per_token(times, "hf", new))])
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="160m", help="recipe whose backbone both models take (SYNTHETIC weights)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object (progress to stderr)")
    p.add_argument("--quick", action="store_true", help="the tiny shape, a short prompt: seconds, for tests")
    p.add_argument("--budgets", nargs="+", default=[], metavar="FLOPS,MEM",
                   help="the serve-time dial: TriRoute once more per (FLOPs, KV memory) target")
    a = p.parse_args(argv)
    a.budgets = parse_budgets(p, a.budgets)
    if a.quick:
        a.shape, a.prompt_tokens, a.new_tokens, a.repeats = "tiny", 24, 4, 2
    if a.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (decode time is the whole minus the prompt alone)")
    return a


def main(argv=None) -> dict:
    from megatron_triroute.training.recipes import get_recipe

    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if a.json else (lambda s: print(s, flush=True))
    base = get_recipe(a.shape).triroute.validate()
    config = system_config("triroute", base)
    if a.prompt_tokens + a.new_tokens > config.model.seq_len:
        raise SystemExit(f"--prompt-tokens + --new-tokens = {a.prompt_tokens + a.new_tokens} exceeds the shape's "
                         f"sequence length {config.model.seq_len}")
    mix = budget_mix(config, a.prompt_tokens + a.new_tokens)
    log(f"{a.shape} shape, SYNTHETIC weights; prompt {a.prompt_tokens} tokens, {a.new_tokens} new; {a.threads} "
        f"thread(s); TriRoute's forced mix: {json.dumps(mix)}")
    prompt = torch.randint(1, config.model.vocab_size, (a.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    import transformers

    result = {"shape": a.shape, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens, "repeats": a.repeats,
              "threads": a.threads, "machine": platform.machine(), "torch": torch.__version__,
              "transformers": transformers.__version__, "mix": mix,
              "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    dial = {(f, m): budget_mix(at_budget(base, f, m), a.prompt_tokens + a.new_tokens) for f, m in a.budgets}
    result |= measure(Runs(config, mix, dial), prompt.tolist(), a.new_tokens, a.repeats, log)
    s, r = result["seconds"], result
    log(f"whole generation: TriRoute {s['triroute_whole']['median']:.3f} s, transformers Dense "
        f"{s['hf_whole']['median']:.3f} s, ratio {r['whole_ratio']['median']:.2f} "
        f"[{r['whole_ratio']['q1']:.2f}-{r['whole_ratio']['q3']:.2f}]; prompt alone ratio "
        f"{r['prompt_ratio']['median']:.2f}; decode per token ratio {r['decode_ratio']['median']:.2f} "
        f"(below 1: TriRoute faster); realised FLOPs {r['realised_fractions']['flops']:.3f}, KV memory "
        f"{r['realised_fractions']['mem']:.3f}")
    for entry in result.get("budget_dial", []):
        log(f"dial ({entry['flops_target']:g}, {entry['mem_target']:g}): whole generation "
            f"{entry['whole_ratio']['median']:.2f} [{entry['whole_ratio']['q1']:.2f}-{entry['whole_ratio']['q3']:.2f}] "
            f"of transformers' time, prompt alone {entry['prompt_ratio']['median']:.2f}, decoded token "
            f"{entry['decode_ratio']['median']:.2f}; realised FLOPs {entry['realised_fractions']['flops']:.3f}, "
            f"KV memory {entry['realised_fractions']['mem']:.3f}")
    if a.json:
        print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
