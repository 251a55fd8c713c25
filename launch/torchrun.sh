#!/usr/bin/env bash
# Start one moontrain worker per GPU (or per CPU process) on this node under torchrun.
#
#   launch/torchrun.sh RECIPE [key=value ...]                      single node, all GPUs (or parallel.ep CPU ranks)
#   NNODES=4 NODE_RANK=0 RDZV_ENDPOINT=host:29500 launch/torchrun.sh recipes/k3_small.yaml
#   NPROC=2 launch/torchrun.sh recipes/k3_tiny.yaml train.steps=10
#
# A thin wrapper over `moontrain launch`, which validates the recipe first and picks nccl on GPU and
# gloo on CPU in the workers.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: [NPROC=N] [NNODES=N NODE_RANK=I RDZV_ENDPOINT=host:port] $0 RECIPE [key=value ...]" >&2
  exit 2
fi
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
args=(launch "$@")
[[ -n "${NPROC:-}" ]] && args+=(--nproc "$NPROC")
if [[ "${NNODES:-1}" -gt 1 ]]; then
  args+=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}" --rdzv-endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT}")
fi
cd "$repo"
exec env PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" python -m moontrain.cli "${args[@]}"
