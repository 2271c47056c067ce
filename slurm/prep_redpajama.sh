#!/usr/bin/env bash
# RedPajama (JSON lines, .jsonl.zst and .parquet shards) -> Megatron indexed datasets, as a Slurm
# job array plus one dependent merge job.
#
#   cd <repo> && sbatch slurm/prep_redpajama.sh
#   INPUT_GLOB='/data/rp/arxiv/*.jsonl /data/rp/c4/*.jsonl' OUT_DIR=/data/prep/rp sbatch slurm/prep_redpajama.sh
#   sbatch --array=0-255%64 slurm/prep_redpajama.sh   # more tasks, at most 64 running at once
#
# Array task i runs `python -m data_prep shard --task-index i --num-tasks N`: it parses its
# contiguous range of the sorted shards into $OUT_DIR/work/parsed/. The first task submits the
# merge job with --dependency=afterok:$SLURM_ARRAY_JOB_ID; it dedups across all shards, trains
# (or loads) the tokenizer and writes the datasets, buckets, token tables and summary.json.
# Resumable: if anything fails, submit the same command again; finished shards are verified
# by checksum and skipped. Run a stage by hand: PREP_STAGE=merge bash slurm/prep_redpajama.sh
#
# Environment overrides (defaults in brackets):
#   INPUT_GLOB [/data/redpajama]  space-separated globs/paths (** recurses), expanded by data_prep;
#                                 a directory means every .jsonl[.zst|.gz]/.parquet under it (and its
#                                 .txt files as one text shard), and each pattern must match something
#   OUT_DIR [$PWD/data/prep/redpajama]   VOCAB_SIZE [50000]   TOKENIZER [unset: train one; else a .model]
#   VALID_FRACTION [0.005]   TEXT_FIELD [text]   LONG_CONTEXT_TOKENS [4096]   SEED [1234]
#   WORKERS [$SLURM_CPUS_PER_TASK]   TOKENIZER_THREADS [16]   PYTHON [python]
#   MERGE_CPUS [32]   MERGE_MEM [128G]   MERGE_TIME [12:00:00]   PREP_SUBMIT_MERGE [1]
#SBATCH --job-name=prep-redpajama
#SBATCH --array=0-127%64
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
#SBATCH --time=06:00:00
#SBATCH --output=slurm-%x-%A_%a.out
set -euo pipefail

DATASET=redpajama
INPUT_GLOB=${INPUT_GLOB:-/data/redpajama}
VALID_FRACTION=${VALID_FRACTION:-0.005}

REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}}
source "$REPO/slurm/common_prep.sh"
