#!/bin/bash
# The matched-budget sweep as one job array: array task i trains line i of the plan that
# `python -m megatron_triroute.sweep --slurm` writes (RECIPE <tab> RUN_DIR <tab> overrides), with the
# same checkpoint / USR1 / requeue logic as slurm/train_*.sh. The sweep command prints the exact
# sbatch line, e.g.
#
#   PLAN=$PWD/runs/sweep/sweep_plan.tsv DATA=$PWD/data/tiny sbatch --array=0-17 slurm/sweep.sh
#   # a CPU node (no GRES): one rank per array task
#   PLAN=... DATA=... sbatch --array=0-17 --nodes=1 --ntasks-per-node=1 --gpus-per-node=0 \
#     --cpus-per-task=1 --time=60 --signal=B:USR1@60 slurm/sweep.sh
#
# then `python -m megatron_triroute.sweep --collect ...` (printed too) evaluates the finished points.
# Environment: PLAN (required), DATA, TRAIN_ARGS (appended to each line's overrides), SCALE_ARGS,
# TRIROUTE_PYTHON, TRIROUTE_MAX_RESTARTS as in slurm/common_train.sh. Submit from the repository root
# (or set REPO).
#SBATCH --job-name=triroute-sweep
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out

: "${REPO:=$(cd "$(dirname "$(scontrol show job "$SLURM_JOB_ID" | sed -n '/^ *Command=/{s///p;q;}')")/.." && pwd)}"
source "$REPO/slurm/common_train.sh" || { echo "no $REPO/slurm/common_train.sh: submit from the repository root or set REPO" >&2; exit 2; }

: "${PLAN:?PLAN=path of the sweep_plan.tsv that python -m megatron_triroute.sweep --slurm wrote}"
[ -f "$PLAN" ] || { echo "no sweep plan at $PLAN: run python -m megatron_triroute.sweep --slurm first" >&2; exit 2; }
task=${SLURM_ARRAY_TASK_ID:?not an array task: submit with sbatch --array=0-N (the sweep command prints it)}
line=$(sed -n "$((task + 1))p" "$PLAN")
[ -n "$line" ] || { echo "array task $task: $PLAN has $(wc -l <"$PLAN") points (0-$(( $(wc -l <"$PLAN") - 1 )))" >&2; exit 2; }
IFS=$'\t' read -r RECIPE RUN_DIR point_args <<<"$line"
TRAIN_ARGS="$point_args${TRAIN_ARGS:+ $TRAIN_ARGS}"
triroute_train_job
