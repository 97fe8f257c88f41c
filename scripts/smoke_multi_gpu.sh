#!/usr/bin/env bash
# CI multi-GPU smoke job: TP over every visible GPU with NCCL, a generation check and a
# clean shutdown. On a host without CUDA the same flow runs on CPU with gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/smoke_multi_gpu.py "$@"
