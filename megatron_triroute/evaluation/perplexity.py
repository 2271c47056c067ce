"""Held-out and tail-bucket perplexity on the hard path, with the realised cost of each set.

The sets are the ones the trainer evaluates (`training/data.py`): the held-out micro-batches of
`validation_batches` (the run's validation GPTDataset, `train.eval_batches` rounded up to the
data-parallel size that wrote the checkpoint) and each tail bucket's windows from
`bucket_batches`, scored where their loss masks say. Every sequence runs through the inference
engine (`scoring.score_batch`); a fresh `CostAudit` per set gives the realised FLOPs fraction
(executed attention-read + expert MACs over the dense model's on the same tokens) and the realised
KV-memory fraction (bytes written over a dense 16-bit cache) of exactly the tokens run. A bucket
window runs only up to its last scored token (its end padding is not run or counted).
"""

from __future__ import annotations

import math
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from ..inference.audit import CostAudit
from .loading import Loaded
from ..progress import Progress
from .scoring import score_batch


@dataclass
class SetResult:
    name: str
    batches: int
    scored_tokens: int
    """Tokens whose next-token loss counts (the loss mask's sum)."""
    run_tokens: int
    """Tokens the engine ran (what the realised fractions are over)."""
    nll: float | None
    """Mean negative log-likelihood per scored token (nats); None for an empty set."""
    ppl: float | None
    realised_flops: float | None
    realised_mem: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def run_config(loaded: Loaded, eval_batches: int | None = None):
    """The run's `RunConfig` as recorded, with data.path set to the data directory in use."""
    from ..training.config import RunConfig

    run = RunConfig.from_dict(loaded.tree)
    run.data.path = str(loaded.data)
    if eval_batches is not None:
        if eval_batches < 1:
            raise ValueError(f"--eval-batches={eval_batches}: must be >= 1")
        run.train.eval_batches = eval_batches
    return run


@contextmanager
def run_datasets(loaded: Loaded, eval_batches: int | None = None, data_parallel: int | None = None):
    """(run config, data-parallel size, train, valid): the run's GPTDatasets, built as the trainer
    builds them; read them inside the block (their index may live in a temporary directory)."""
    with warnings.catch_warnings():  # Megatron's import-time notices about optional GPU packages
        warnings.simplefilter("ignore")
        from ..training import data as data_mod

    run = run_config(loaded, eval_batches)
    dp = data_parallel or int(loaded.layout.get("dp", 1))
    # Reuse the run's dataset index cache when it is next to the checkpoint root (same files the
    # trainer read); otherwise build the (deterministic) index in a temporary directory.
    run_dir = loaded.step_path.parent.parent
    with tempfile.TemporaryDirectory(prefix="triroute-eval-") as scratch:
        run.output_dir = str(run_dir if (run_dir / "data_cache").is_dir() else scratch)
        train, valid = data_mod.build_datasets(run, loaded.eod, run.triroute.model.vocab_size, data_parallel=dp)
        yield run, dp, train, valid


def evaluation_sets(loaded: Loaded, eval_batches: int | None = None, data_parallel: int | None = None) -> dict:
    """{"valid": [MicroBatch], bucket name: [MicroBatch]}: the trainer's evaluation sets."""
    from ..training import data as data_mod

    with run_datasets(loaded, eval_batches, data_parallel) as (run, dp, _, valid):
        sets = {"valid": data_mod.validation_batches(valid, run, dp)}
    for name in run.data.buckets:
        sets[name] = data_mod.bucket_batches(run, name, loaded.eod, dp)
    return sets


def _rows(mb) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """Inputs, targets and masks of a micro-batch's rows, each cut after its last scored token;
    rows with nothing to score (padding micro-batches) are dropped."""
    inputs, targets, masks = [], [], []
    for tok, lab, mask in zip(mb.tokens, mb.labels, mb.loss_mask):
        scored = mask.nonzero()
        if scored.numel() == 0:
            continue
        end = int(scored.max()) + 1
        inputs.append(tok[:end].tolist())
        targets.append(lab[:end].tolist())
        masks.append(mask[:end].double())
    return inputs, targets, masks


def evaluate_sets(model, sets: dict, page_size: int = 16, progress: Progress | None = None) -> list[SetResult]:
    results = []
    for name, batches in sets.items():
        audit = CostAudit(model.config.model.n_layers)
        nll, count = 0.0, 0.0
        for i, mb in enumerate(batches):
            inputs, targets, masks = _rows(mb)
            for scored, mask in zip(score_batch(model, inputs, targets, audit, page_size), masks):
                nll -= float((scored.logprobs * mask).sum())
                count += float(mask.sum())
            if progress is not None:
                progress.update(sum(len(x) for x in inputs), f"{name} {i + 1}/{len(batches)}",
                                force=i + 1 == len(batches))
        if count == 0:
            results.append(SetResult(name, len(batches), 0, 0, None, None, None, None))
            continue
        mean = nll / count
        # exp capped as the trainer caps it (math.exp(min(loss, 50))).
        results.append(SetResult(name, len(batches), int(count), audit.tokens, mean, math.exp(min(mean, 50.0)),
                                 audit.realised_flops(), audit.realised_mem()))
    return results


def total_tokens(sets: dict) -> int:
    return sum(len(x) for batches in sets.values() for mb in batches for x in _rows(mb)[0])


def flat_metrics(results: list[SetResult]) -> dict[str, float]:
    """The trainer's `summary.json` names: valid/ppl, valid/realised_{flops,mem}, valid/{bucket}_ppl,
    plus valid/{bucket}_realised_{flops,mem} (the trainer does not report those)."""
    out = {}
    for r in results:
        if r.ppl is None:
            continue
        prefix = "valid/" if r.name == "valid" else f"valid/{r.name}_"
        out[prefix + "ppl"] = r.ppl
        out[prefix + "realised_flops"] = r.realised_flops
        out[prefix + "realised_mem"] = r.realised_mem
    return out


__all__ = ["SetResult", "evaluation_sets", "evaluate_sets", "flat_metrics", "run_config", "run_datasets",
           "total_tokens"]
