#!/usr/bin/env bash
# The one prepared run on the GPU test machine (../shared/gpu/README.md: one H200, 16
# cores, python 3.12 with torch 2.11 and triton 3.6, no network, about 8 minutes), from
# the repository root of a checkout that carries .whl/ (../shared/gpu/fetch_wheels.sh):
#
#   bash scripts/gpu_check.sh            # logs under $OUT (default ./gpu-check-out)
#
# Steps, each under its own `timeout` (SIGINT first, so that pytest and the benchmarks
# print what they have; SIGKILL 5 s later), each cut to what is left of TOTAL_S, and
# the next one run whatever the last one's exit code:
#
#   wheels     the carried wheels into /tmp/site (PYTHONPATH=$PWD:/tmp/site; nothing is
#              pip-installed from the checkout itself)          -> env.txt
#   env        date, nvidia-smi, versions, a missing import named  -> env.txt
#   pytest     python3 -m pytest -m cuda                         -> pytest_cuda.log
#   smoke      scripts/smoke_multi_gpu.sh (TP=2 sharing the GPU)  -> smoke.log
#   bench      scripts/bench_gpu.py (1B and 8B shapes)            -> bench_gpu.log
#   tp         scripts/bench_tp_scaling.py, TP 1/2/4, 4 cores/rank -> tp_scaling.log
#
# summary.txt gets one line per step (exit code, seconds) and the lines that matter from
# each log (pytest's last line, SMOKE, TARGET/INFO, TP=t / TP=1): read it first. Six files
# in all (the machine returns at most 8). STEP_S_<name> overrides a step's seconds. Exits
# 1 when any step failed, after running them all.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
TOTAL_S="${TOTAL_S:-465}"  # under the machine's 8 minutes, with the machine's own start-up outside it
KILL_AFTER_S=5
SUMMARY="$OUT/summary.txt"
ENV_TXT="$OUT/env.txt"
START=$SECONDS
FAILED=()

export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TMPDIR="${TMPDIR:-/tmp}"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"  # every gloo group here is on this host; it has no network

echo "gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), total budget ${TOTAL_S}s" > "$SUMMARY"

# run_step NAME SECONDS LOG COMMAND...: the command under timeout, output appended to LOG.
run_step() {
    local name=$1 seconds=$2 log=$3
    shift 3
    local override="STEP_S_$name"
    seconds="${!override:-$seconds}"
    local left=$((TOTAL_S - (SECONDS - START) - KILL_AFTER_S))
    if ((left < 10)); then
        echo "$name: skipped (no time left of ${TOTAL_S}s)" | tee -a "$SUMMARY"
        return
    fi
    ((seconds > left)) && seconds=$left
    local begin=$SECONDS
    echo "== $name: $* (timeout ${seconds}s) $(date -u +%H:%M:%S)" >> "$log"
    timeout -s INT -k "$KILL_AFTER_S" "$seconds" "$@" >> "$log" 2>&1
    local rc=$?
    local note=""
    ((rc == 124 || rc == 137)) && note=" (timed out)"
    ((rc != 0)) && FAILED+=("$name")
    echo "$name: exit $rc$note in $((SECONDS - begin))s (limit ${seconds}s) -> $(basename "$log")" | tee -a "$SUMMARY"
}

environment() {
    date -u
    uname -a
    git rev-parse HEAD 2>/dev/null || echo "checkout without git metadata"
    nproc
    lscpu | grep -E "^(Model name|CPU\(s\)|Thread|NUMA node\(s\))" || true
    { command -v cc && cc --version | head -n 1; } || echo "no C compiler: our CPU kernels cannot build"
    free -g
    df -h /tmp | tail -1
    nvidia-smi || echo "nvidia-smi failed"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv || true
    python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
          "memory GiB %.1f" % (torch.cuda.mem_get_info()[1] / 2**30))
missing = []
for name in ("triton", "transformers", "safetensors", "tokenizers", "huggingface_hub", "numpy", "psutil",
             "cloudpickle", "msgspec", "zmq", "fastapi", "uvicorn", "pydantic", "prometheus_client", "jinja2",
             "openai", "httpx", "gguf", "pytest", "pytest_timeout"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as e:  # noqa: BLE001 - listed, not fatal
        missing.append(name)
        print(name, "MISSING:", type(e).__name__, e)
print("missing imports:", ", ".join(missing) or "none")
EOF
}

install_wheels() {
    if ! compgen -G ".whl/*.whl" > /dev/null; then
        echo "no .whl/*.whl in the checkout: run ../shared/gpu/fetch_wheels.sh where the index is reachable, and carry .whl"
        return 1
    fi
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
}

export -f environment install_wheels  # `timeout` runs programs: these run in `bash -c`
run_step wheels 30 "$ENV_TXT" bash -c install_wheels
run_step env 15 "$ENV_TXT" bash -c environment
grep -E "^missing imports:" "$ENV_TXT" | tee -a "$SUMMARY"

# Only the files that mark tests `cuda` are collected: a test module that imports what
# the machine lacks (ray) would otherwise stop the session at collection, and
# --continue-on-collection-errors keeps one such file from stopping the others.
# -p no:cacheprovider: the checkout may be read-only. No pytest-timeout flag: the plugin
# may be absent (pyproject's `timeout` ini key then only warns); faulthandler dumps the
# stacks of a test stuck past 90 s.
mapfile -t CUDA_TEST_FILES < <(grep -rlE "mark\.cuda\b" tests --include="*.py" | sort)
run_step pytest 100 "$OUT/pytest_cuda.log" \
    python3 -m pytest -q -m cuda -p no:cacheprovider -o faulthandler_timeout=90 -rfEs --durations=10 \
    --continue-on-collection-errors "${CUDA_TEST_FILES[@]:-tests}"
tail -n 1 "$OUT/pytest_cuda.log" | sed 's/^/pytest: /' | tee -a "$SUMMARY"

run_step smoke 65 "$OUT/smoke.log" bash scripts/smoke_multi_gpu.sh
grep -E "^(SMOKE|WARN)" "$OUT/smoke.log" | tee -a "$SUMMARY"

run_step bench 170 "$OUT/bench_gpu.log" python3 scripts/bench_gpu.py --rounds 2 --time-budget 160
grep -E "^(card limits|TARGET|INFO)" "$OUT/bench_gpu.log" | tee -a "$SUMMARY"

run_step tp 70 "$OUT/tp_scaling.log" \
    python3 scripts/bench_tp_scaling.py --tp 1 2 4 --cores-per-rank 4 --rounds 2 --dtypes float32 bfloat16 \
    --model-root /tmp/tp-bench-models
grep -E "TP=[0-9]+ / TP=1|round [0-9]+:" "$OUT/tp_scaling.log" | tee -a "$SUMMARY"

echo "total $((SECONDS - START))s; failed steps: ${FAILED[*]:-none}" | tee -a "$SUMMARY"
((${#FAILED[@]} == 0))
