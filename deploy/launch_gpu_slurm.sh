#!/usr/bin/env bash
# Run one k3jax program across GPU nodes with SLURM (multi-controller JAX, one program per process).
#
#   deploy/launch_gpu_slurm.sh [--per-gpu | --per-host] [--nodes N] [--gpus-per-node G]
#                               [--port PORT] [--python PY] [--env KEY=VALUE]... [--dry-run]
#                               [--srun-arg ARG]... -- MODULE [ARGS...]
#
# Inside an allocation (salloc/sbatch) it runs `srun` with one task per GPU (--per-gpu, the
# default: each process sees one GPU) or one task per node (--per-host: each process sees all
# G GPUs of its node). Each task exports
#   K3JAX_COORDINATOR=<first node of the job>:PORT  K3JAX_NUM_PROCESSES=$SLURM_NTASKS
#   K3JAX_PROCESS_ID=$SLURM_PROCID  (per-gpu: K3JAX_LOCAL_DEVICE_IDS=$SLURM_LOCALID)
# and runs `PY -m sharding.launch MODULE ARGS...`. Examples:
#
#   salloc -N 2 --gpus-per-node 8 deploy/launch_gpu_slurm.sh -- sharding.check --mesh expert=2,tensor=8
#   sbatch -N 4 --gpus-per-node 8 --wrap "deploy/launch_gpu_slurm.sh --per-host -- k3jax.serve --model /ckpt/k3"
set -euo pipefail

MODE="per-gpu" NODES="${SLURM_JOB_NUM_NODES:-1}" GPN="${SLURM_GPUS_ON_NODE:-8}" PORT=29517 PY="python3" DRY=0
ENVS=() SRUN_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --per-gpu) MODE="per-gpu"; shift ;;
    --per-host) MODE="per-host"; shift ;;
    --nodes) NODES="$2"; shift 2 ;;
    --gpus-per-node) GPN="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --env) ENVS+=("$2"); shift 2 ;;
    --srun-arg) SRUN_ARGS+=("$2"); shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "launch_gpu_slurm.sh: unknown option $1 (the program goes after --)" >&2; exit 2 ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "usage: $0 [--per-gpu|--per-host] [--nodes N] [--gpus-per-node G] [--port P] -- MODULE [ARGS...]" >&2
  exit 2
fi
if [[ "$MODE" == "per-gpu" ]]; then TASKS="$GPN"; else TASKS=1; fi

# Runs inside every task: SLURM_* are per task there. The first node of the step coordinates.
TASK_SCRIPT='
first=$(scontrol show hostnames "${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}" | head -n1)
export K3JAX_COORDINATOR="${first}:'"$PORT"'"
export K3JAX_NUM_PROCESSES="$SLURM_NTASKS" K3JAX_PROCESS_ID="$SLURM_PROCID"
if [[ "'"$MODE"'" == per-gpu ]]; then export K3JAX_LOCAL_DEVICE_IDS="$SLURM_LOCALID"; fi
exec "$@"'

CMD=(srun --nodes="$NODES" --ntasks-per-node="$TASKS" --gpus-per-node="$GPN" --kill-on-bad-exit=1)
CMD+=(${SRUN_ARGS[@]+"${SRUN_ARGS[@]}"})
CMD+=(bash -c "$TASK_SCRIPT" k3jax-task env ${ENVS[@]+"${ENVS[@]}"} "$PY" -m sharding.launch "$@")
if [[ $DRY -eq 1 ]]; then
  printf '%q ' "${CMD[@]}"; echo
else
  exec "${CMD[@]}"
fi
