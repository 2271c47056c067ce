#!/bin/bash
# The comparison and ablation grid as one job array: array task i trains SCALE-NAME for the i-th of
# the six systems and the ten Table 4 variants (megatron_triroute.systems.SYSTEMS + VARIANTS), each
# into its own run directory, with the same checkpoint / USR1 / requeue logic as slurm/train_*.sh.
#
#   sbatch slurm/ablations.sh                          # all 16 at 410m (the paper's ablation scale)
#   sbatch --array=0-5 slurm/ablations.sh              # the six systems only; --array=6-15: the variants
#   sbatch --array=3,9%2 slurm/ablations.sh            # kvquant and single_head, at most 2 at a time
#   SCALE=160m DATA=/data/prep/pile sbatch --nodes=1 slurm/ablations.sh
#   # a CPU node (no GRES): the tiny scale, one rank per array task
#   SCALE=tiny DATA=data/tiny TRAIN_ARGS="train.steps=50" sbatch --array=0-1 --nodes=1 \
#     --ntasks-per-node=1 --gpus-per-node=0 --cpus-per-task=1 --time=30 --signal=B:USR1@60 slurm/ablations.sh
#
# Environment: SCALE [410m]; RUN_ROOT [$REPO/runs/ablations]: task i writes RUN_ROOT/SCALE-NAME;
# DATA, TRAIN_ARGS, SCALE_ARGS, TRIROUTE_PYTHON, TRIROUTE_MAX_RESTARTS as in slurm/common_train.sh
# (RECIPE, SYSTEM and RUN_DIR are set per task and ignored from the environment). Submit from the
# repository root (or set REPO). tests/slurm/test_training_jobs.py checks that the list below equals
# the Python one and that --array covers it.
#SBATCH --job-name=triroute-ablations
#SBATCH --array=0-15
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out

ABLATIONS=(
  dense mod moe kvquant independent triroute
  token_attention layer_group_attention separate_routers single_head no_grad_balance
  no_whitening no_entropy_floor reinforce no_null_expert uniform_bits
)

: "${REPO:=$(cd "$(dirname "$(scontrol show job "$SLURM_JOB_ID" | sed -n '/^ *Command=/{s///p;q;}')")/.." && pwd)}"
source "$REPO/slurm/common_train.sh" || { echo "no $REPO/slurm/common_train.sh: submit from the repository root or set REPO" >&2; exit 2; }

task=${SLURM_ARRAY_TASK_ID:?not an array task: submit with sbatch (the script sets --array)}
if [ "$task" -lt 0 ] || [ "$task" -ge "${#ABLATIONS[@]}" ]; then
  echo "array task $task is outside 0-$((${#ABLATIONS[@]} - 1)) (${ABLATIONS[*]})" >&2
  exit 2
fi
SCALE=${SCALE:-410m}
SYSTEM=${ABLATIONS[$task]}
RECIPE=$SCALE-$SYSTEM
RUN_ROOT=${RUN_ROOT:-$REPO/runs/ablations}
RUN_DIR=$RUN_ROOT/$RECIPE
triroute_train_job
