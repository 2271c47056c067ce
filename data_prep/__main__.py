"""Command line: `python -m data_prep {build,shard,merge,corpus}` (also `triroute-data-prep`).

  build   --output DIR [--input PATH_OR_GLOB ...]   everything, in one process tree; without
                                                    --input, on the embedded stdlib corpus
  shard   --input ... --output DIR --task-index I --num-tasks N    one Slurm array task
  merge   --input ... --output DIR                  dedup, tokenizer, datasets (after all shards)
  corpus  --output DIR [--max-docs N]               write the embedded corpus as .jsonl.zst shards

Exit status: 0 on success (bad records are counted and written to rejects.jsonl, never fatal);
2 when an input cannot be opened, an option is invalid, or nothing valid remains.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from data_prep.config import BucketConfig, PrepConfig, PrepError, ShardConfig, TokenizerConfig
from data_prep.corpus import CorpusConfig
from megatron_triroute.input_errors import InputError

log = logging.getLogger("data_prep")


def _add_shard_options(parser: argparse.ArgumentParser, input_required: bool) -> None:
    parser.add_argument("--input", action="append", default=[], required=input_required, metavar="PATH_OR_GLOB",
                        help="a file, a glob (quote it), or a directory; repeatable. Formats: .jsonl, .jsonl.zst, "
                             ".jsonl.gz, .parquet, directories of .txt")
    parser.add_argument("--output", required=True, metavar="DIR")
    parser.add_argument("--text-field", default="text", help="JSON key / parquet column of the text (default: text)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (outputs do not depend on it)")


def _add_merge_options(parser: argparse.ArgumentParser) -> None:
    defaults, bucket = TokenizerConfig(), BucketConfig()
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", metavar="MODEL", help="use this sentencepiece .model instead of training one")
    which.add_argument("--vocab-size", type=int, default=defaults.vocab_size,
                       help=f"vocabulary to train (default {defaults.vocab_size}; the paper's recipes use ~50000)")
    parser.add_argument("--tokenizer-sample-bytes", type=int, default=defaults.sample_bytes)
    parser.add_argument("--tokenizer-threads", type=int, default=defaults.threads,
                        help="sentencepiece trainer threads; the model depends on it, so keep it fixed across runs")
    parser.add_argument("--valid-fraction", type=float, default=PrepConfig.valid_fraction)
    parser.add_argument("--seed", type=int, default=PrepConfig.seed)
    parser.add_argument("--long-context-tokens", type=int, default=bucket.long_context_min_tokens)
    parser.add_argument("--rare-entity-max-count", type=int, default=bucket.rare_entity_max_train_count)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_prep", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="shard + merge in one go")
    _add_shard_options(build, input_required=False)
    _add_merge_options(build)
    build.add_argument("--max-docs", type=int, default=CorpusConfig.max_docs,
                       help="document cap of the embedded corpus (used only without --input)")

    shard = commands.add_parser("shard", help="parse this task's range of shards (a Slurm array task)")
    _add_shard_options(shard, input_required=True)
    shard.add_argument("--task-index", type=int, default=0)
    shard.add_argument("--num-tasks", type=int, default=1)

    merge = commands.add_parser("merge", help="dedup, tokenizer, datasets, buckets (after every shard task)")
    _add_shard_options(merge, input_required=True)
    _add_merge_options(merge)

    corpus = commands.add_parser("corpus", help="write the embedded stdlib corpus as Pile-format shards")
    corpus.add_argument("--output", required=True, metavar="DIR")
    corpus.add_argument("--max-docs", type=int, default=CorpusConfig.max_docs)
    corpus.add_argument("--max-bytes", type=int, default=CorpusConfig.max_bytes)
    corpus.add_argument("--shards", type=int, default=CorpusConfig.shards)
    return parser


def _shard_config(args) -> ShardConfig:
    return ShardConfig(inputs=list(args.input), output=args.output, text_field=args.text_field, workers=args.workers)


def _prep_config(args) -> PrepConfig:
    return PrepConfig(
        shard=_shard_config(args),
        tokenizer=TokenizerConfig(model=args.tokenizer, vocab_size=args.vocab_size,
                                  sample_bytes=args.tokenizer_sample_bytes, threads=args.tokenizer_threads),
        buckets=BucketConfig(long_context_min_tokens=args.long_context_tokens,
                             rare_entity_max_train_count=args.rare_entity_max_count),
        valid_fraction=args.valid_fraction,
        seed=args.seed,
    )


def run(args) -> None:
    from data_prep import pipeline
    from data_prep.corpus import build_corpus

    if args.command == "corpus":
        paths = build_corpus(Path(args.output), CorpusConfig(max_docs=args.max_docs, max_bytes=args.max_bytes,
                                                             shards=args.shards))
        log.info("wrote %d corpus shards to %s", len(paths), args.output)
    elif args.command == "shard":
        pipeline.run_shard_stage(_shard_config(args), args.task_index, args.num_tasks)
    elif args.command == "merge":
        pipeline.run_merge(_prep_config(args))
    else:
        if not args.input:
            corpus_dir = Path(args.output) / "corpus"
            build_corpus(corpus_dir, CorpusConfig(max_docs=args.max_docs))
            log.info("no --input: using the embedded stdlib corpus written to %s", corpus_dir)
            args.input = [str(corpus_dir)]
        pipeline.run_build(_prep_config(args))


def main(argv: list[str] | None = None) -> int:
    # Our own logger only: configuring the root logger would also print Megatron's INFO chatter.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[data_prep] %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (PrepError, InputError) as err:  # InputError: what the shared vocabulary files refuse
        print(f"data_prep: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from megatron_triroute.process_exit import exit_process

    exit_process(main())
