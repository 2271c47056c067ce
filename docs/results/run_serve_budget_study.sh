#!/usr/bin/env bash
# "Serve anywhere" against "train for each budget" (docs/results.md, "Serving at any budget"): TriRoute
# trained at each budget below for STEPS steps (the study's length), then the one trained at the
# study's budget (0.55, 0.40) served at every budget by per-request prices. A stopped run resumes
# (finished points are not trained again).
#
#   bash docs/results/run_serve_budget_study.sh     # DATA=data/tiny OUT=runs/serve_study STEPS=600 JOBS=1
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
DATA=${DATA:-data/tiny}
OUT=${OUT:-runs/serve_study}
STEPS=${STEPS:-600}
JOBS=${JOBS:-1}
BUDGETS=${BUDGETS:-"0.5,0.3 0.55,0.4 0.65,0.5 0.8,0.7 0.9,0.85"}
COMMON=("train.steps=$STEPS" train.eval_interval=1000000 train.save_interval_steps=1000000 train.log_interval=50)
for pair in $BUDGETS; do
  f=${pair%,*} m=${pair#*,}
  "$PY" -m megatron_triroute.sweep --recipe tiny --data "$DATA" --output "$OUT/trained_${f}_${m}" --jobs "$JOBS" \
      --seeds 1 --systems triroute --flops-target "$f" --mem-target "$m" \
      --grid "triroute:budget.flops_target=$f" --grid "triroute:budget.mem_target=$m" "${COMMON[@]}"
done
"$PY" benchmarks/bench_serve_budget.py --checkpoint \
    "$OUT/trained_0.55_0.4/runs/triroute/flops_target0.55_mem_target0.4/seed1/checkpoints" --data "$DATA" \
    --output "$OUT/served"
