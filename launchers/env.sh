# Shared logic for Slurm batch scripts (slurm/train_*.sh). Source it, do not execute it:
#
#   #SBATCH --requeue --open-mode=append --signal=B:USR1@120
#   source "$REPO/launchers/env.sh"
#   triroute_append_log "$RUN_DIR/job.log"     # optional: one log across restarts
#   triroute_slurm_env                         # MASTER_ADDR / MASTER_PORT / restart count
#   triroute_srun python -m ... ; status=$?     # forwards USR1/TERM from this script to the tasks
#   triroute_requeue_if_needed "$status"       # resumes the job if it checkpointed on a signal
#   exit "$status"
#
# Exit codes agree with megatron_triroute/training/signals.py: 0 finished, 75 checkpointed on a
# signal ("resume me"); anything else is a failure and is never requeued.
# Not `set -e` friendly by design: the caller needs srun's non-zero status as a value.

TRIROUTE_EXIT_FINISHED=0
TRIROUTE_EXIT_REQUEUE=75
# How many times one job may be requeued after checkpointing on a signal.
: "${TRIROUTE_MAX_RESTARTS:=3}"

triroute_log() {
  echo "[triroute $(date -u +%Y-%m-%dT%H:%M:%SZ) job=${SLURM_JOB_ID:-none} restart=${SLURM_RESTART_COUNT:-0}] $*"
}

# Appends this script's stdout and stderr to FILE (Slurm truncates --output on requeue unless
# --open-mode=append, and a per-run log must survive every restart).
triroute_append_log() {
  mkdir -p "$(dirname "$1")"
  exec >>"$1" 2>&1
  triroute_log "batch script started on $(hostname)"
}

# First host of a Slurm node list ("node[01-04]" -> node01).
triroute_first_host() {
  local first
  first=$(scontrol show hostnames "$1" 2>/dev/null | head -n 1)
  echo "${first:-${1%%,*}}"
}

# Exports the rendezvous address and port every task derives identically, plus the restart count.
# The port formula matches megatron_triroute.distributed.launch_env.port_from_job_id.
triroute_slurm_env() {
  if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "triroute_slurm_env: SLURM_JOB_ID is not set (not inside a Slurm job)" >&2
    return 1
  fi
  export MASTER_ADDR=${MASTER_ADDR:-$(triroute_first_host "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}")}
  export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 12768))}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
  export TRIROUTE_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}
  triroute_log "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT nodes=${SLURM_JOB_NODELIST:-?}"
}

# Runs `srun "$@"` in the background and waits for it, forwarding USR1 and TERM received by this
# script (e.g. from `#SBATCH --signal=B:USR1@120` or `scancel --signal=USR1 --batch`) to srun, which
# passes them to every task. A foreground srun would delay the trap until srun had exited.
# Returns srun's exit status.
triroute_srun() {
  local status
  srun "$@" &
  TRIROUTE_SRUN_PID=$!
  trap 'triroute_log "got USR1: forwarding to the job step"; kill -USR1 "$TRIROUTE_SRUN_PID" 2>/dev/null' USR1
  # TERM goes on as USR1 (the trainer treats both as a stop): a TERM sent to every process of the
  # job (a pre-emption, `scancel --full`) has reached srun too, which then ends the step after
  # KillWait, and a second TERM makes srun kill the tasks at once, in the middle of their stop checkpoint.
  trap 'triroute_log "got TERM: forwarding to the job step as USR1"; kill -USR1 "$TRIROUTE_SRUN_PID" 2>/dev/null' TERM
  while :; do
    wait "$TRIROUTE_SRUN_PID"
    status=$?
    # A trapped signal interrupts `wait` with status > 128 while srun is still running.
    if [ "$status" -gt 128 ] && kill -0 "$TRIROUTE_SRUN_PID" 2>/dev/null; then
      continue
    fi
    break
  done
  trap - USR1 TERM
  return "$status"
}

# Requeues this job when the step exited with TRIROUTE_EXIT_REQUEUE and the job has restarted fewer
# than TRIROUTE_MAX_RESTARTS times. `scontrol requeue` ends this script, so it must come last and
# the checkpoint must already be on disk (the trainer exits 75 only after saving). Returns STATUS.
triroute_requeue_if_needed() {
  local status=$1 restarts=${SLURM_RESTART_COUNT:-0}
  if [ "$status" -ne "$TRIROUTE_EXIT_REQUEUE" ]; then
    triroute_log "step exited $status: not requeueing"
    return "$status"
  fi
  if [ "$restarts" -ge "$TRIROUTE_MAX_RESTARTS" ]; then
    triroute_log "step checkpointed on a signal but the job already restarted $restarts times (max $TRIROUTE_MAX_RESTARTS): not requeueing"
    return "$status"
  fi
  triroute_log "step checkpointed on a signal: requeueing (restart $((restarts + 1)) of at most $TRIROUTE_MAX_RESTARTS)"
  if ! scontrol requeue "$SLURM_JOB_ID"; then
    triroute_log "scontrol requeue failed (job submitted without --requeue?)"
  fi
  return "$status"
}
