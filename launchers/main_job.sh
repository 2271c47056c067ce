#!/usr/bin/env bash
# The main job on the embedded default: build the corpus from the Python standard library, train
# a tokenizer and build the datasets, then pretrain the `tiny` TriRoute recipe on this machine.
#   bash launchers/main_job.sh [key=value ...]      (e.g. train.steps=50 for a smoke run)
# Outputs: data/tiny (datasets, tokenizer), runs/tiny (checkpoints, TensorBoard, summary.json).
set -euo pipefail
cd "$(dirname "$0")/.."
source launchers/common.sh
DATA=${DATA:-data/tiny}
RUN=${RUN:-runs/tiny}
if [ ! -f "$DATA/summary.json" ]; then
  "$TRIROUTE_PYTHON" -m data_prep corpus --output "$DATA/corpus"
  "$TRIROUTE_PYTHON" -m data_prep build --input "$DATA/corpus/*.jsonl.zst" --output "$DATA" --vocab-size 4096 --workers 2
fi
# Two threads for one rank: the whole machine on the 2-core CI box.
OMP_NUM_THREADS=${OMP_NUM_THREADS_MAIN:-2} NPROC=${NPROC:-1} bash launchers/local.sh --recipe tiny \
  data.path="$DATA" output_dir="$RUN" "$@"
echo "TensorBoard: $TRIROUTE_PYTHON -m tensorboard.main --logdir $RUN/tensorboard"
echo "Summary: $RUN/summary.json"
