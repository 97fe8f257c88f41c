#!/usr/bin/env bash
# CI multi-GPU smoke job: TP over every visible GPU with NCCL (the multiprocess backend,
# then the same under torchrun with the external launcher), the tokens checked against
# TP=1, and a shutdown that leaves no process, /dev/shm segment or temporary file of
# ours. On CUDA: bfloat16, the KV cache sized by a profile run under
# --gpu-memory-utilization (each GPU's use checked against it), and on a one-GPU
# runner --gpu-tp ranks (default 2) sharing the GPU through tp_communicator="gloo". On a
# host without CUDA the same flow runs on CPU (gloo and shared memory) at --cpu-tp ranks
# (default 2).
#
# Prints one summary line (`SMOKE OK ...` / `SMOKE FAIL ...`) with the phase timings and
# exits non-zero on any failure. Extra arguments go to scripts/smoke_multi_gpu.py
# (--model DIR, --cpu-tp N, --gpu-tp N, --gpu-memory-utilization F, --no-torchrun).
# PYTHON picks the interpreter (default python3).
# --help prints this text and the Python script's flags, and starts nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' scripts/smoke_multi_gpu.sh
    echo
    exec "${PYTHON:-python3}" scripts/smoke_multi_gpu.py --help
fi

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L || true  # the GPUs as the driver sees them; torch's view decides the TP size
fi
exec "${PYTHON:-python3}" scripts/smoke_multi_gpu.py "$@"
