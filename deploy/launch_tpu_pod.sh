#!/usr/bin/env bash
# Run one k3jax program on every worker of a Cloud TPU VM pod slice (multi-controller JAX).
#
#   deploy/launch_tpu_pod.sh --tpu NAME --zone ZONE [--project P] [--repo DIR] [--python PY]
#                             [--env KEY=VALUE]... [--dry-run] -- MODULE [ARGS...]
#
# Every worker runs `cd DIR && K3JAX_DISTRIBUTED=auto KEY=VALUE... PY -m sharding.launch MODULE ARGS...`.
# sharding.launch calls jax.distributed.initialize(), which on TPU VMs finds the coordinator,
# process count and process id by itself (K3JAX_DISTRIBUTED=auto asks for that). Example:
#
#   deploy/launch_tpu_pod.sh --tpu k3-v5p-128 --zone us-east5-a -- \
#       k3jax.serve --model /mnt/k3 --mesh data=4,expert=16   # (serve's mesh flag: see docs/sharding.md)
#   deploy/launch_tpu_pod.sh --tpu k3-v5p-128 --zone us-east5-a -- sharding.check --mesh expert=-1
#
# The repository (and checkpoint) must already be on every worker at the same path, e.g.
#   gcloud compute tpus tpu-vm scp --recurse . NAME:~/k3jax --worker=all --zone ZONE
set -euo pipefail

TPU="" ZONE="" PROJECT="" REPO="~/k3jax" PY="python3" DRY=0
ENVS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tpu) TPU="$2"; shift 2 ;;
    --zone) ZONE="$2"; shift 2 ;;
    --project) PROJECT="$2"; shift 2 ;;
    --repo) REPO="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --env) ENVS+=("$2"); shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "launch_tpu_pod.sh: unknown option $1 (the program goes after --)" >&2; exit 2 ;;
  esac
done
if [[ -z "$TPU" || -z "$ZONE" || $# -eq 0 ]]; then
  echo "usage: $0 --tpu NAME --zone ZONE [--project P] [--repo DIR] [--env K=V]... -- MODULE [ARGS...]" >&2
  exit 2
fi

# The remote command line, each word shell-quoted so arguments survive ssh unchanged.
REMOTE="cd $REPO && K3JAX_DISTRIBUTED=auto"
for kv in ${ENVS[@]+"${ENVS[@]}"}; do REMOTE+=" $(printf '%q' "$kv")"; done
REMOTE+=" $(printf '%q' "$PY") -m sharding.launch"
for a in "$@"; do REMOTE+=" $(printf '%q' "$a")"; done

CMD=(gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command "$REMOTE")
[[ -n "$PROJECT" ]] && CMD+=(--project "$PROJECT")
if [[ $DRY -eq 1 ]]; then
  printf '%q ' "${CMD[@]}"; echo
else
  exec "${CMD[@]}"
fi
