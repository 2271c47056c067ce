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

# ---- identical in prep_pile.sh and prep_redpajama.sh from here on ---------------------------
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}}
cd "$REPO"
SELF="$REPO/slurm/prep_${DATASET}.sh"
OUT_DIR=${OUT_DIR:-$PWD/data/prep/$DATASET}
VOCAB_SIZE=${VOCAB_SIZE:-50000}
TEXT_FIELD=${TEXT_FIELD:-text}
WORKERS=${WORKERS:-${SLURM_CPUS_PER_TASK:-1}}
PYTHON=${PYTHON:-python}
STAGE=${PREP_STAGE:-shard}

read -r -a PATTERNS <<< "$INPUT_GLOB"
INPUT_ARGS=()
for pattern in "${PATTERNS[@]}"; do INPUT_ARGS+=(--input "$pattern"); done  # data_prep expands globs
COMMON=("${INPUT_ARGS[@]}" --output "$OUT_DIR" --text-field "$TEXT_FIELD" --workers "$WORKERS")

if [ "$STAGE" = shard ]; then
  TASK_INDEX=$(( ${SLURM_ARRAY_TASK_ID:-0} - ${SLURM_ARRAY_TASK_MIN:-0} ))
  NUM_TASKS=${SLURM_ARRAY_TASK_COUNT:-1}
  if [ "${PREP_SUBMIT_MERGE:-1}" = 1 ] && [ -n "${SLURM_ARRAY_JOB_ID:-}" ] && [ "$TASK_INDEX" = 0 ]; then
    mkdir -p "$OUT_DIR/work"
    # mkdir is atomic: a requeued first task does not submit a second merge.
    MARKER="$OUT_DIR/work/merge-submitted-$SLURM_ARRAY_JOB_ID"
    if mkdir "$MARKER" 2>/dev/null; then
      if ! sbatch --parsable --dependency="afterok:$SLURM_ARRAY_JOB_ID" --job-name="prep-$DATASET-merge" \
          --cpus-per-task="${MERGE_CPUS:-32}" --mem="${MERGE_MEM:-128G}" --time="${MERGE_TIME:-12:00:00}" \
          --output="slurm-%x-%j.out" --chdir="$REPO" --export=ALL \
          --wrap="PREP_STAGE=merge WORKERS=${MERGE_CPUS:-32} bash $(printf '%q' "$SELF")"; then
        rmdir "$MARKER"  # let a rerun try again
        echo "[prep_$DATASET] could not submit the merge job" >&2
        exit 1
      fi
    fi
  fi
  echo "[prep_$DATASET] shard task $TASK_INDEX of $NUM_TASKS -> $OUT_DIR" >&2
  exec "$PYTHON" -m data_prep shard "${COMMON[@]}" --task-index "$TASK_INDEX" --num-tasks "$NUM_TASKS"
elif [ "$STAGE" = merge ]; then
  TOKENIZER_ARGS=(--vocab-size "$VOCAB_SIZE")
  if [ -n "${TOKENIZER:-}" ]; then TOKENIZER_ARGS=(--tokenizer "$TOKENIZER"); fi
  echo "[prep_$DATASET] merge -> $OUT_DIR" >&2
  exec "$PYTHON" -m data_prep merge "${COMMON[@]}" "${TOKENIZER_ARGS[@]}" \
    --valid-fraction "$VALID_FRACTION" --seed "${SEED:-1234}" \
    --tokenizer-threads "${TOKENIZER_THREADS:-16}" --long-context-tokens "${LONG_CONTEXT_TOKENS:-4096}"
else
  echo "[prep_$DATASET] PREP_STAGE=$STAGE: expected shard or merge" >&2
  exit 2
fi
