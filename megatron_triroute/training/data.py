"""Data for training and evaluation from `python -m data_prep build` outputs.

Training and validation samples come from Megatron-Core's `GPTDataset` through its
`BlendedMegatronDatasetBuilder` (deterministic shuffling from the data seed). Global batch b is
samples [b * G, (b + 1) * G) of that order, cut into micro-batches of `micro_batch_size`;
data-parallel rank r takes micro-batches r, r + dp, ... So the global batch sequence and every
sample's global index (the routing noise key) are the same whatever the data-parallel size,
which is what makes resuming on a different number of ranks continue the same run.

Tail buckets are document-level indexed datasets with a parallel loss mask; they are cut into
windows of the model's sequence length and scored only where the mask says.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import RunConfig
from .engine import MicroBatch

log = logging.getLogger(__name__)


@dataclass
class TokenizerInfo:
    """What Megatron's GPTDataset needs to know about the tokenizer."""

    vocab_size: int
    eod: int
    pad: int = -1
    unique_identifiers: dict | None = None


def load_tables(run: RunConfig):
    """Token tables saved with the tokenizer (log-probabilities, word starts, EOD id)."""
    from ..routing.side_features import TokenTables
    from ..vocab import load_token_tables, tables_path

    path = tables_path(Path(run.data.path))
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: data.path={run.data.path!r} is not a data_prep output. "
                                "Fix: run `python -m data_prep build ... --output DIR` and set data.path=DIR.")
    log_prob, word_start, eod = load_token_tables(path)
    return TokenTables(log_prob=log_prob, word_start=word_start, eod_id=eod)


def padded_vocab(vocab: int, tensor_parallel: int, multiple: int = 128) -> int:
    """Vocabulary padded so the vocab-parallel embedding splits evenly (ours: multiple of 128 x TP)."""
    step = multiple * tensor_parallel
    return -(-vocab // step) * step


def pad_tables(tables, vocab: int):
    """`tables` (TokenTables) extended to `vocab` ids (`padded_vocab`). Padding ids never occur in
    data: they get the rarest observed log-probability and start no word."""
    from ..routing.side_features import TokenTables

    extra = vocab - tables.log_prob.numel()
    if extra < 0:
        raise ValueError(f"vocab={vocab} is smaller than the token tables' {tables.log_prob.numel()} ids")
    if extra == 0:
        return tables
    return TokenTables(torch.cat([tables.log_prob, torch.full((extra,), float(tables.log_prob.min()))]),
                       torch.cat([tables.word_start, torch.zeros(extra, dtype=torch.bool)]), tables.eod_id)


def build_datasets(run: RunConfig, eod: int, vocab: int, barrier=None, data_parallel: int = 1):
    """(train, valid) GPTDatasets sized for the whole run. The index cache is built by the
    first rank before the others read it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    root = Path(run.data.path)
    prefixes = [str(root / p) for p in run.data.train_prefixes]
    for prefix in prefixes + [str(root / run.data.valid_prefix)]:
        if not Path(prefix + ".idx").exists():
            raise FileNotFoundError(f"{prefix}.idx not found. Fix: build the data with `python -m data_prep build`.")
    weights = list(run.data.train_weights) or None
    config = GPTDatasetConfig(
        random_seed=run.data.seed, sequence_length=run.triroute.model.seq_len,
        tokenizer=TokenizerInfo(vocab_size=vocab, eod=eod, unique_identifiers={}),
        path_to_cache=str(Path(run.output_dir) / "data_cache"),
        blend_per_split=[(prefixes, weights), ([str(root / run.data.valid_prefix)], None), None],
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
    )
    t = run.train
    sizes = [t.steps * t.global_batch_size, evaluation_micro_batches(run, data_parallel) * t.micro_batch_size, None]
    import torch.distributed as dist

    first = not dist.is_initialized() or dist.get_rank() == 0
    builder = lambda: BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    if first:
        train, valid, _ = builder()
    if barrier is not None:
        barrier()
    if not first:
        train, valid, _ = builder()
    return train, valid


def micro_batches(dataset, step: int, run: RunConfig, dp_rank: int, dp: int) -> list[MicroBatch]:
    """This rank's micro-batches of global batch `step` (see module docstring)."""
    t = run.train
    first = step * t.global_batch_size
    n_micro = t.global_batch_size // t.micro_batch_size
    out = []
    for k in range(dp_rank, n_micro, dp):
        index = torch.arange(first + k * t.micro_batch_size, first + (k + 1) * t.micro_batch_size)
        out.append(_collate(dataset, index))
    return out


def _collate(dataset, index: torch.Tensor) -> MicroBatch:
    samples = [dataset[int(i)] for i in index]
    stack = lambda key, dtype: torch.as_tensor(np.stack([s[key] for s in samples])).to(dtype)
    return MicroBatch(stack("tokens", torch.long), stack("labels", torch.long), stack("loss_mask", torch.float), index)


def evaluation_micro_batches(run: RunConfig, data_parallel: int) -> int:
    """Micro-batches one evaluation scores: `train.eval_batches` is a total the data-parallel ranks
    share, rounded up to a multiple of their number, since every rank must run the same number
    (expert-parallel all-to-alls span the data-parallel ranks). Any world size can evaluate."""
    return -(-run.train.eval_batches // data_parallel) * data_parallel


def calibration_batches(train, run: RunConfig, end_step: int, data_parallel: int = 1) -> list[MicroBatch]:
    """The price calibration's batches: the global batches trained last before `end_step`, as many
    micro-batches as an evaluation scores. Training data, so the held-out report stays held out."""
    t = run.train
    n_micro = t.global_batch_size // t.micro_batch_size
    wanted = evaluation_micro_batches(run, data_parallel)
    steps_needed = min(end_step, -(-wanted // n_micro))
    found = [mb for s in range(end_step - steps_needed, end_step) for mb in micro_batches(train, s, run, 0, 1)]
    return found[:wanted]


def validation_batches(dataset, run: RunConfig, data_parallel: int = 1) -> list[MicroBatch]:
    mbs = run.train.micro_batch_size
    n = min(evaluation_micro_batches(run, data_parallel), len(dataset) // mbs)
    n -= n % data_parallel
    return [_collate(dataset, torch.arange(i * mbs, (i + 1) * mbs)) for i in range(n)]


def pad_to_ranks(batches: list[MicroBatch], data_parallel: int) -> list[MicroBatch]:
    """Append copies of the last micro-batch with an all-zero loss mask (they score nothing) until
    every data-parallel rank has the same number of micro-batches."""
    out = list(batches)
    while out and len(out) % data_parallel:
        last = out[-1]
        out.append(MicroBatch(last.tokens, last.labels, torch.zeros_like(last.loss_mask), last.sample_index))
    return out


def bucket_batches(run: RunConfig, name: str, eod: int, data_parallel: int = 1) -> list[MicroBatch]:
    """Windows of a tail bucket: tokens, next-token labels, and the bucket's own loss mask
    (scored tokens only). Empty when the bucket has no documents."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    root = Path(run.data.path) / "buckets"
    tokens_path, mask_path = root / f"{name}_text_document", root / f"{name}_loss_mask"
    if not Path(str(tokens_path) + ".idx").exists():
        return []
    docs, masks = IndexedDataset(str(tokens_path)), IndexedDataset(str(mask_path))
    T, mbs = run.triroute.model.seq_len, run.train.micro_batch_size
    windows: list[tuple[np.ndarray, np.ndarray]] = []
    limit = evaluation_micro_batches(run, data_parallel) * mbs
    for i in range(len(docs)):
        tok, msk = np.asarray(docs[i], dtype=np.int64), np.asarray(masks[i], dtype=np.float32)
        for start in range(0, max(len(tok) - 1, 1), T):
            chunk, chunk_mask = tok[start : start + T + 1], msk[start : start + T + 1]
            if chunk_mask[1:].sum() == 0:
                continue
            pad = T + 1 - len(chunk)
            windows.append((np.pad(chunk, (0, pad), constant_values=eod), np.pad(chunk_mask, (0, pad))))
            if len(windows) >= limit:
                break
        if len(windows) >= limit:
            break
    # Whole micro-batches only, unless the bucket has fewer windows than one micro-batch.
    usable = len(windows) if len(windows) < mbs else len(windows) - len(windows) % mbs
    batches = []
    for b in range(0, usable, mbs):
        group = windows[b : b + mbs]
        tok = torch.as_tensor(np.stack([w[0] for w in group]))
        msk = torch.as_tensor(np.stack([w[1] for w in group]))
        batches.append(MicroBatch(tok[:, :-1].contiguous(), tok[:, 1:].contiguous(), msk[:, 1:].contiguous(),
                                  torch.arange(b, b + len(group))))
    return pad_to_ranks(batches, data_parallel)
