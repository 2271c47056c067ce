# Shared body of slurm/train_160m.sh, slurm/train_410m.sh, slurm/train_1p3b.sh and slurm/ablations.sh.
# Sourced (never executed) by a batch script that has set REPO and SCALE (ablations.sh also SYSTEM):
#
#   triroute_train_job        # trains $RECIPE into $RUN_DIR through srun, requeues on exit 75, exits
#
# Environment (defaults in brackets; sbatch passes the submitting shell's environment to the job,
# and a requeued job keeps it):
#   RECIPE      [$SCALE, or $SCALE-$SYSTEM when SYSTEM is set]  any `--recipe` name: tiny, 410m-moe, ...
#   SYSTEM      [unset]  one of the six systems or a Table 4 variant (megatron_triroute.systems)
#   RUN_DIR     [$REPO/runs/$RECIPE]  checkpoints, steps.jsonl, summary.json and job.log (one log
#               across restarts). Per run, not per job id: job ids restart when a cluster's state is
#               wiped, and a resubmitted job must find the same checkpoints. Relative: to the submit dir.
#   DATA        [unset: the recipe's data.path, data/<scale> in the repository]  a `data_prep build`
#               output directory. Relative: to the submit directory.
#   TRAIN_ARGS  [empty]  extra key=value overrides, split on white space ("train.steps=12 parallel.tensor=2")
#   SCALE_ARGS  [the capacity planner's layout for the paper scales, see triroute_scale_args] applied
#               before TRAIN_ARGS; set it empty to drop them.
#   TRIROUTE_GPU_MEMORY_GIB [80]  TRIROUTE_PEAK_TFLOPS [989]  what the planner assumes per GPU
#   TRIROUTE_PYTHON [$REPO/.venv/bin/python if present, else python3 on PATH]
#   TRIROUTE_MAX_RESTARTS [3]  requeues per job after a checkpointed stop (exit 75)
#   TRIROUTE_DRY_RUN [0]  1: print and dry-run the exact training command at the job's world size, train nothing
# Nodes, tasks per node (= GPUs per node), GPUs and CPUs per task come from sbatch's own flags; the
# step runs one task per allocated task slot, so `sbatch --nodes=1 --ntasks-per-node=2
# --gpus-per-node=0 --cpus-per-task=1 slurm/train_1p3b.sh` runs two CPU ranks.

source "$REPO/launchers/env.sh"

# A stop signal that reaches this script before srun runs (triroute_srun installs its forwarding
# traps only once srun has started) would kill it with the default action. Record it instead:
# nothing was trained since the last checkpoint, so the job is simply requeued.
TRIROUTE_EARLY_STOP=
triroute_trap_early_stop() {
  trap 'TRIROUTE_EARLY_STOP=USR1' USR1
  trap 'TRIROUTE_EARLY_STOP=TERM' TERM
}
triroute_trap_early_stop

# The layout of the paper scales (tensor, pipeline and expert parallel, micro-batch, recompute) is
# picked by the capacity planner for the allocation the job got (`--plan`, see docs/slurm.md):
# the fastest estimated step that fits TRIROUTE_GPU_MEMORY_GIB [80] per GPU, expert parallelism
# inside a node. TRAIN_ARGS take part in the plan and still override its pick. Other recipes
# (tiny, CPU runs) get no layout overrides.
#   triroute_scale_args RECIPE NODES TASKS_PER_NODE [TRAIN_ARGS...]
triroute_scale_args() {
  local recipe=$1 nodes=$2 per_node=$3
  shift 3
  case "${recipe%%-*}" in
    160m|410m|1p3b)
      "$TRIROUTE_PYTHON" -m megatron_triroute.train --recipe "$recipe" --plan --overrides-only \
        --nodes "$nodes" --gpus-per-node "$per_node" --gpu-memory-gib "${TRIROUTE_GPU_MEMORY_GIB:-80}" \
        --peak-tflops "${TRIROUTE_PEAK_TFLOPS:-989}" "$@" 2>/dev/null ;;
    *) echo "" ;;
  esac
}

# srun's status after a checkpointed stop is not always 75. The ranks leave the trainer's final
# barrier together but finish exiting at different times; once the first one has exited 75,
# --kill-on-bad-exit SIGTERMs the others, and a rank already in interpreter shutdown (where Python
# has put SIGTERM back to its default action) dies of it: srun then reports 143. If srun died of a
# signal (status > 128) after the trainer logged, in this step's output, that it had checkpointed
# step N on a stop signal, and `latest` names step N, the stop is complete: the status is 75.
# Anything else is returned unchanged. Prints the status.
triroute_stop_status() {
  local status=$1 offset=$2 step latest
  if [ "$status" -le 128 ]; then echo "$status"; return; fi
  step=$(tail -c +$((offset + 1)) "$RUN_DIR/job.log" 2>/dev/null \
    | grep -o 'stop signal: checkpointed at step [0-9]*, exiting with 75' | tail -n 1 | grep -o '[0-9]\+' | head -n 1)
  latest=$(cat "$RUN_DIR/checkpoints/latest" 2>/dev/null)
  if [ -n "$step" ] && [ "$latest" = "$(printf 'step_%08d' "$step")" ]; then
    triroute_log "srun exited $status after the trainer checkpointed step $step on a stop signal (a rank still exiting was terminated): treating it as $TRIROUTE_EXIT_REQUEUE" >&2
    echo "$TRIROUTE_EXIT_REQUEUE"
  else
    echo "$status"
  fi
}

# True while this job is being cancelled by scancel (not by its time limit or a node failure).
triroute_job_cancelled() {
  local info
  info=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null) || return 1
  [[ $info =~ JobState=COMPLETING[[:space:]]+Reason=None([[:space:]]|$) ]]
}

triroute_train_job() {
  local status scale_args=() extra=()
  if [ -z "${RECIPE:-}" ]; then
    RECIPE=${SCALE:?SCALE or RECIPE must be set}${SYSTEM:+-$SYSTEM}
  fi
  RUN_DIR=${RUN_DIR:-$REPO/runs/$RECIPE}
  case "$RUN_DIR" in /*) ;; *) RUN_DIR=$PWD/$RUN_DIR ;; esac
  if [ -z "${TRIROUTE_PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then TRIROUTE_PYTHON=$REPO/.venv/bin/python; else TRIROUTE_PYTHON=python3; fi
  fi
  local nodes=${SLURM_JOB_NUM_NODES:-1}
  local per_node=${SLURM_NTASKS_PER_NODE:-$(( ${SLURM_NTASKS:-1} / nodes ))}
  # Word splitting without glob expansion.
  read -r -a extra <<<"${TRAIN_ARGS:-}"
  if [ -z "${SCALE_ARGS+set}" ]; then
    SCALE_ARGS=$(triroute_scale_args "$RECIPE" "$nodes" "$per_node" "${extra[@]}") || {
      triroute_log "the capacity planner found no layout of $RECIPE for $nodes x $per_node GPUs (run --plan by hand)"
      exit 2
    }
  fi
  read -r -a scale_args <<<"$SCALE_ARGS"
  # GPU jobs save checkpoints asynchronously (the trainer's default with CUDA, stated here so the
  # job's command says it); TRAIN_ARGS may still set train.async_save=false.
  local gpus=${SLURM_GPUS_PER_NODE:-0}
  if [ -n "$gpus" ] && [ "${gpus##*:}" != 0 ]; then scale_args+=("train.async_save=true"); fi
  extra=("${scale_args[@]}" "${extra[@]}")
  if [ -n "${DATA:-}" ]; then
    case "$DATA" in /*) ;; *) DATA=$PWD/$DATA ;; esac
    extra+=("data.path=$DATA")
  fi
  extra+=("output_dir=$RUN_DIR")  # last: the log, the checkpoints and the outputs stay together
  if [ "${TRIROUTE_DRY_RUN:-0}" = 1 ]; then
    # Validate this job's exact command at its allocation's world size; train nothing.
    echo "dry run: $TRIROUTE_PYTHON -m megatron_triroute.train --recipe $RECIPE --dry-run --world-size $((nodes * per_node)) ${extra[*]}"
    cd "$REPO" && PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} "$TRIROUTE_PYTHON" -m megatron_triroute.train \
      --recipe "$RECIPE" --dry-run --world-size $((nodes * per_node)) "${extra[@]}"
    exit $?
  fi

  triroute_append_log "$RUN_DIR/job.log"
  triroute_slurm_env || exit 1
  export PYTHONUNBUFFERED=1
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
  cd "$REPO" || exit 1

  local cpus=${SLURM_CPUS_PER_TASK:-1}
  local latest="$RUN_DIR/checkpoints/latest"
  triroute_log "recipe $RECIPE -> $RUN_DIR: $nodes node(s) x $per_node task(s), $cpus CPU(s) per task, GPUs per node ${SLURM_GPUS_PER_NODE:-none}"
  if [ -f "$latest" ]; then
    triroute_log "checkpoint $(cat "$latest") in $RUN_DIR/checkpoints: training resumes from it"
  else
    triroute_log "no checkpoint in $RUN_DIR/checkpoints: training starts at step 0"
  fi

  if [ -n "$TRIROUTE_EARLY_STOP" ]; then
    triroute_log "got $TRIROUTE_EARLY_STOP before the step started: nothing to checkpoint"
    status=$TRIROUTE_EXIT_REQUEUE
  else
    local log_offset
    log_offset=$(stat -c %s "$RUN_DIR/job.log" 2>/dev/null || echo 0)
    triroute_log "srun: $TRIROUTE_PYTHON -m megatron_triroute.train --recipe $RECIPE ${extra[*]}"
    # srun does not inherit --cpus-per-task from sbatch (Slurm 22.05+): pass the layout explicitly.
    triroute_srun --kill-on-bad-exit=1 --nodes="$nodes" --ntasks-per-node="$per_node" \
      --ntasks=$((nodes * per_node)) --cpus-per-task="$cpus" \
      "$TRIROUTE_PYTHON" -m megatron_triroute.train --recipe "$RECIPE" "${extra[@]}"
    status=$?
    triroute_trap_early_stop  # triroute_srun resets the traps to the default (fatal) action
    status=$(triroute_stop_status "$status" "$log_offset")
  fi
  case "$status" in
    0) triroute_log "training finished: $RUN_DIR/summary.json" ;;
    "$TRIROUTE_EXIT_REQUEUE") triroute_log "training checkpointed on a stop signal (exit $status)" ;;
    *) triroute_log "training failed (exit $status)" ;;
  esac
  # `scancel JOBID` SIGTERMs the batch script and the step: the trainer checkpoints and exits 75 as on
  # a pre-emption, and Slurm would accept the requeue of the job it is cancelling. While a cancelled
  # job winds down, scontrol shows JobState=COMPLETING with Reason=None (a time limit shows
  # Reason=TimeLimit). A cancelled job stays cancelled: resubmit to resume from the checkpoint.
  if [ "$status" -eq "$TRIROUTE_EXIT_REQUEUE" ] && triroute_job_cancelled; then
    triroute_log "job cancelled (scancel): not requeueing; resubmit the same command to resume from the checkpoint"
    exit "$status"
  fi
  triroute_requeue_if_needed "$status"
  exit "$status"
}
