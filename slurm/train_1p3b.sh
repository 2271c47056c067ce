#!/bin/bash
# Pretrain the 1p3b recipe (any of the six systems or the Table 4 variants) on 8 node(s) x 8 GPUs.
#
#   sbatch slurm/train_1p3b.sh                                   # TriRoute, runs/1p3b, data/1p3b
#   SYSTEM=moe DATA=/data/prep/pile sbatch slurm/train_1p3b.sh   # recipe 1p3b-moe into runs/1p3b-moe
#   sbatch --nodes=4 slurm/train_1p3b.sh                         # sbatch flags override the #SBATCH lines
#   # a CPU node (no GRES): the tiny recipe on two ranks
#   RECIPE=tiny DATA=data/tiny RUN_DIR=runs/tiny-slurm TRAIN_ARGS="train.steps=50" \
#     sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 --time=30 slurm/train_1p3b.sh
#
# Submit from the repository root (or set REPO). One task per GPU; training resumes from the latest
# checkpoint in RUN_DIR. USR1 arrives 900 s before the time limit: the trainer checkpoints and exits 75,
# and the job requeues itself (at most TRIROUTE_MAX_RESTARTS times). Environment: see
# slurm/common_train.sh and docs/slurm.md.
#SBATCH --job-name=triroute-1p3b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

SCALE=1p3b
# sbatch runs a copy of this script from its spool directory: find the repository from the submitted path.
: "${REPO:=$(cd "$(dirname "$(scontrol show job "$SLURM_JOB_ID" | sed -n '/^ *Command=/{s///p;q;}')")/.." && pwd)}"
source "$REPO/slurm/common_train.sh" || { echo "no $REPO/slurm/common_train.sh: submit from the repository root or set REPO" >&2; exit 2; }
triroute_train_job
