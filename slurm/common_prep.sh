# Shared body of slurm/prep_pile.sh and slurm/prep_redpajama.sh (sourced, not run): the array
# task's shard stage and the dependent merge. The caller sets DATASET, INPUT_GLOB, VALID_FRACTION
# and REPO, and has `set -euo pipefail`.
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
