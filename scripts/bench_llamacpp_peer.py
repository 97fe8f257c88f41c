"""What bench_vs_llamacpp.py runs under llama.cpp's venv (../shared/peers/llama-cpp/):

    $LLAMACPP_PYTHON scripts/bench_llamacpp_peer.py serve --model F.gguf --threads 2 --parallel 16 --ctx-per-slot 272
    $LLAMACPP_PYTHON scripts/bench_llamacpp_peer.py quantize      # rows in on stdin, blocks out on stdout

`serve`: llama-server in this process (xllamacpp's `Server`), then bench_held's
protocol: the workload on stdin, `measure_decode` through llama.cpp's native
`/completion` route with token-id prompts (greedy: temperature 0 and top_k 1; EOS
ignored; no prompt cache, so every request is prefilled as ours is), the RESULT line
(with `ready_s`: from the `Server` call until /health answers 200), held until released. Concurrent requests are one HTTP request per thread, all at once,
into `--parallel` slots with continuous batching. `--threads` is both its decode and
batch thread count; the process inherits the parent's CPU affinity.

`quantize`: llama.cpp's own quantiser (`ggml_quantize_chunk` from the wheel's shared
object, through ctypes) for bench_gguf_model.py's PeerQuantizer. Per tensor, stdin
carries a JSON header line `{"type": "Q4_K", "nrows": R, "n_per_row": N}` and R*N
float32 values; stdout gets the stored size (8 bytes, little-endian) and the blocks.
Ends at EOF. Memory: one tensor's rows and blocks.

Standard library and xllamacpp only: this venv has no torch and none of our package.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_held import measure_decode, serve_held  # noqa: E402

GGML_TYPES = {"Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # enum ggml_type


def _ggml_library() -> ctypes.CDLL:
    import xllamacpp

    lib = ctypes.CDLL(str(next(Path(xllamacpp.__file__).parent.glob("xllamacpp*.so"))))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


def quantize_stream() -> None:
    lib = _ggml_library()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        line = stdin.readline()
        if not line.strip():
            return
        header = json.loads(line)
        ggml_type, nrows, n_per_row = GGML_TYPES[header["type"]], header["nrows"], header["n_per_row"]
        src = bytearray(stdin.read(4 * nrows * n_per_row))
        if len(src) != 4 * nrows * n_per_row:
            raise SystemExit("quantize: short read")
        dst = bytearray(lib.ggml_row_size(ggml_type, n_per_row) * nrows)
        src_ptr = (ctypes.c_char * len(src)).from_buffer(src)
        dst_ptr = (ctypes.c_char * len(dst)).from_buffer(dst)
        written = lib.ggml_quantize_chunk(ggml_type, src_ptr, dst_ptr, 0, nrows, n_per_row, None)
        if written != len(dst):
            raise SystemExit(f"quantize: ggml_quantize_chunk wrote {written} bytes, expected {len(dst)}")
        stdout.write(struct.pack("<Q", len(dst)))
        stdout.write(dst)
        stdout.flush()


def start_server(args: argparse.Namespace):
    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = args.model
    params.n_parallel = args.parallel
    params.n_ctx = args.parallel * args.ctx_per_slot
    params.cont_batching = True
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.n_threads_http = args.parallel + 4  # one per in-flight request, and a few for the rest
    params.sampling.temp = 0.0
    params.sampling.top_k = 1
    params.warmup = True
    return xlc.Server(params)


def wait_until_healthy(base_url: str, timeout: float = 600.0) -> None:
    """Until llama-server's /health answers 200 (503 while it loads); RuntimeError after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=10) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass  # not listening yet, or 503 while loading
        if time.monotonic() > deadline:
            raise RuntimeError(f"llama-server at {base_url} not healthy after {timeout:.0f} s")
        time.sleep(0.01)


def completion_client(base_url: str):
    """`generate(prompts, max_tokens)` over llama.cpp's native /completion, one request
    per prompt, all in flight at once."""

    def one(prompt: list[int], max_tokens: int, out: list, index: int) -> None:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        request = urllib.request.Request(f"{base_url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as response:
            out[index] = json.loads(response.read())["tokens"]

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        out: list = [None] * len(prompts)
        threads = [threading.Thread(target=one, args=(p, max_tokens, out, i)) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(o is None for o in out):
            raise RuntimeError("a /completion request failed (see the traceback above)")
        return out

    return generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["serve", "quantize"])
    p.add_argument("--model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parallel", type=int, default=16)
    p.add_argument("--ctx-per-slot", type=int, default=272)
    args = p.parse_args()
    if args.mode == "quantize":
        quantize_stream()
        return
    start = time.perf_counter()
    server = start_server(args)
    base_url = server.listening_address.rstrip("/")
    if not base_url.startswith("http"):
        base_url = "http://" + base_url
    wait_until_healthy(base_url)
    ready_s = time.perf_counter() - start
    generate = completion_client(base_url)
    # the server lives on: held
    serve_held(lambda workload, hold: hold({**measure_decode(generate, workload), "ready_s": ready_s}))


if __name__ == "__main__":
    main()
