#!/usr/bin/env bash
# The Pile -> Megatron indexed datasets, as a Slurm job array plus one dependent merge job.
#
#   cd <repo> && sbatch slurm/prep_pile.sh
#   INPUT_GLOB='/data/pile/train/*.jsonl.zst' OUT_DIR=/data/prep/pile VOCAB_SIZE=50000 sbatch slurm/prep_pile.sh
#   sbatch --array=0-14 slurm/prep_pile.sh      # fewer tasks: each takes a contiguous range of shards
#
# Array task i runs `python -m data_prep shard --task-index i --num-tasks N`: it parses its
# contiguous range of the sorted shards into $OUT_DIR/work/parsed/. The first task submits the
# merge job with --dependency=afterok:$SLURM_ARRAY_JOB_ID; it dedups across all shards, trains
# (or loads) the tokenizer and writes the datasets, buckets, token tables and summary.json.
# Resumable: if anything fails, submit the same command again; finished shards are verified
# by checksum and skipped. Run a stage by hand: PREP_STAGE=merge bash slurm/prep_pile.sh
#
# Environment overrides (defaults in brackets):
#   INPUT_GLOB [/data/pile/train/*.jsonl.zst]  space-separated globs/paths, expanded by data_prep
#   OUT_DIR [$PWD/data/prep/pile]   VOCAB_SIZE [50000]   TOKENIZER [unset: train one; else a .model]
#   VALID_FRACTION [0.005]   TEXT_FIELD [text]   LONG_CONTEXT_TOKENS [4096]   SEED [1234]
#   WORKERS [$SLURM_CPUS_PER_TASK]   TOKENIZER_THREADS [16]   PYTHON [python]
#   MERGE_CPUS [32]   MERGE_MEM [128G]   MERGE_TIME [12:00:00]   PREP_SUBMIT_MERGE [1]
#SBATCH --job-name=prep-pile
#SBATCH --array=0-29
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
#SBATCH --time=06:00:00
#SBATCH --output=slurm-%x-%A_%a.out
set -euo pipefail

DATASET=pile
INPUT_GLOB=${INPUT_GLOB:-/data/pile/train/*.jsonl.zst}
VALID_FRACTION=${VALID_FRACTION:-0.005}

REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}}
source "$REPO/slurm/common_prep.sh"
