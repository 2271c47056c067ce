#!/bin/bash
# Pretrain the 410m recipe (any of the six systems or the Table 4 variants) on 2 node(s) x 8 GPUs.
#
#   sbatch slurm/train_410m.sh                                   # TriRoute, runs/410m, data/410m
#   SYSTEM=moe DATA=/data/prep/pile sbatch slurm/train_410m.sh   # recipe 410m-moe into runs/410m-moe
#   sbatch --nodes=4 slurm/train_410m.sh                         # sbatch flags override the #SBATCH lines
#   # a CPU node (no GRES): the tiny recipe on two ranks
#   RECIPE=tiny DATA=data/tiny RUN_DIR=runs/tiny-slurm TRAIN_ARGS="train.steps=50" \
#     sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 --time=30 slurm/train_410m.sh
#
# Submit from the repository root (or set REPO). One task per GPU; training resumes from the latest
# checkpoint in RUN_DIR. USR1 arrives 600 s before the time limit: the trainer checkpoints and exits 75,
# and the job requeues itself (at most TRIROUTE_MAX_RESTARTS times). Environment: see
# slurm/common_train.sh and docs/slurm.md.
#SBATCH --job-name=triroute-410m
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

SCALE=410m
# sbatch runs a copy of this script from its spool directory: find the repository from the submitted path.
: "${REPO:=$(cd "$(dirname "$(scontrol show job "$SLURM_JOB_ID" | sed -n '/^ *Command=/{s///p;q;}')")/.." && pwd)}"
source "$REPO/slurm/common_train.sh" || { echo "no $REPO/slurm/common_train.sh: submit from the repository root or set REPO" >&2; exit 2; }
triroute_train_job
