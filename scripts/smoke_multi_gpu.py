"""Multi-GPU smoke check for CI: TP over every visible GPU (NCCL), the tokens checked
against TP=1, the same again under torchrun (the external launcher), and a shutdown
that leaves nothing behind.

On CUDA the engines run in bfloat16 with the KV cache sized by a profile run under
--gpu-memory-utilization (no fixed KV bytes), and each engine's device memory is checked
against utilization x total while it runs. With one visible GPU, TP=--gpu-tp ranks
(default 2) share it through tp_communicator="gloo"; with several, TP = their number
with NCCL. On a host without CUDA the same flow runs on CPU (float32, a fixed 64 MiB KV
cache, gloo and the shared-memory communicator) at --cpu-tp ranks. Phases, each timed:

  model     write a tiny random llama to a private temporary directory
  tp1       EngineCore at TP=1: the reference tokens (greedy)
  tpN       EngineCore at TP=N, multiprocess backend: tokens vs TP=1; its workers and
            its IPC directory gone after shutdown
  torchrun  `torchrun --nproc-per-node N` of this script (--torchrun-rank): every rank's
            tokens equal TP=N's; every rank process gone, nothing left in its TMPDIR
  leaks     no /dev/shm segment, temporary directory or socket file of ours left

Prints one summary line, `SMOKE OK ...` or `SMOKE FAIL ...`, with the phase timings;
the exit status is 0 only if every check passed. Used by scripts/smoke_multi_gpu.sh.
On CUDA, TP=N may flip a near-tie against TP=1 (another reduction order, bfloat16):
a sequence may leave TP=1's tokens only where TP=1's own top two logprobs were within
NEAR_TIE_LOGPROB of each other and TP=N took the other one (a warning; the rest of that
sequence is not compared). On CPU, and between TP=N and torchrun, they must be identical.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench_common import REPO, free_port

PROMPTS = [[1, 5, 9, 200, 17, 3], [1] + list(range(40, 90))]
MAX_TOKENS = 16
SHM_PREFIXES = ("tpmq_", "tp-allreduce-")
OUR_TMP_PREFIXES = ("tp-engine-", "smoke-")
TORCHRUN_OWN_TMP_PREFIX = "torchelastic_"  # torchrun's log dir: it never removes it
EXIT_BOUND_S = 30.0  # how long a stopped process may take to disappear
# bfloat16 logits differ by a few hundredths between reduction orders; a wrong shard or
# a missing all-reduce moves them by whole units.
NEAR_TIE_LOGPROB = 0.2
DEFAULT_GPU_MEMORY_UTILIZATION = 0.2
MEMORY_SLACK_BYTES = 512 << 20  # what may exceed utilization x total: allocator rounding, library workspaces


class SmokeFailure(Exception):
    """One check failed; the message says which."""


def engine_kwargs(model: str, device: str, communicator: str = "auto",
                  gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> dict[str, Any]:
    """CUDA: bfloat16, the KV cache from a profile run under `gpu_memory_utilization`, the
    given TP communicator. CPU: float32 and a fixed 64 MiB KV cache."""
    if device == "cuda":
        return dict(model=model, device=device, dtype="bfloat16", gpu_memory_utilization=gpu_memory_utilization,
                    tp_communicator=communicator, max_model_len=256, use_tqdm_on_load=False)
    return dict(model=model, device=device, dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=256,
                use_tqdm_on_load=False)


Generated = tuple[list[list[int]], list[list[dict[int, float]]] | None]


def generate(core: Any, with_logprobs: bool = False) -> Generated:
    """Greedy tokens of PROMPTS, and with `with_logprobs` each token's top-2 logprobs."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                            logprobs=2 if with_logprobs else None)
    outputs = core.generate(PROMPTS, params)
    return [o.token_ids for o in outputs], [o.logprobs for o in outputs] if with_logprobs else None


def check_device_memory(name: str, gpu_memory_utilization: float) -> str:
    """Every visible GPU's used memory (all processes) against utilization x total, while
    an engine runs: the KV cache was sized so that the device stays under it. Returns the
    figures; raises SmokeFailure past MEMORY_SLACK_BYTES over."""
    import torch

    figures = []
    for device in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(device)
        used, limit = total - free, gpu_memory_utilization * total
        figures.append(f"cuda:{device} {used / 2**30:.2f}/{limit / 2**30:.2f} GiB")
        if used > limit + MEMORY_SLACK_BYTES:
            raise SmokeFailure(f"{name}: cuda:{device} uses {used / 2**30:.2f} GiB, over gpu_memory_utilization="
                               f"{gpu_memory_utilization} x {total / 2**30:.2f} GiB = {limit / 2**30:.2f} GiB")
    return "device used/limit: " + ", ".join(figures)


def shm_names() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIXES)}
    except FileNotFoundError:
        return set()


def our_tmp_entries(tmpdir: str) -> set[str]:
    return {n for n in os.listdir(tmpdir) if n.startswith(OUR_TMP_PREFIXES)}


def alive(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + EXIT_BOUND_S
    while True:
        living = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    living.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not living or time.monotonic() > deadline:
            return living
        time.sleep(0.1)


def compare(name: str, got: list[list[int]], want: list[list[int]],
            want_logprobs: list[list[dict[int, float]]] | None = None) -> None:
    """`got` must equal `want`; given the reference's top-2 logprobs, a sequence may leave
    it at a near-tie instead (see the module docstring)."""
    if got == want:
        return
    agree = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y))
    total = sum(len(x) for x in want)
    if want_logprobs is None:
        raise SmokeFailure(f"{name}: greedy tokens differ ({agree}/{total} agree)")
    for seq, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        i = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        top = want_logprobs[seq][i] if i < len(w) else {}
        if i >= min(len(g), len(w)) or g[i] not in top or top[w[i]] - top[g[i]] > NEAR_TIE_LOGPROB:
            raise SmokeFailure(f"{name}: sequence {seq} leaves the reference at token {i} ({g[i:i + 4]} against "
                               f"{w[i:i + 4]}), not at a near-tie (reference's top logprobs there: {top})")
        print(f"WARN: {name}: sequence {seq} flips a near-tie at token {i} (logprob gap "
              f"{top[w[i]] - top[g[i]]:.3f}); the rest of it is not compared")


def run_engine(model: str, device: str, tp: int, backend: str,
               options: dict[str, Any]) -> tuple[Generated, dict[str, Any]]:
    """Generate at `tp` with `backend` (`options`: engine_kwargs' CUDA ones; there, with
    logprobs and the device memory checked); after shutdown, check its workers and IPC
    dir are gone."""
    from engine.core import EngineCore

    with EngineCore(tensor_parallel_size=tp, distributed_executor_backend=backend,
                    **engine_kwargs(model, device, **options)) as core:
        pids = [p.pid for p in getattr(core.model_executor, "processes", [])]
        ipc_dir = getattr(core.model_executor, "_ipc_dir", None)
        generated = generate(core, with_logprobs=device == "cuda")
        memory = check_device_memory(f"tp={tp}", options["gpu_memory_utilization"]) if device == "cuda" else ""
        timings = {k: round(v, 3) for k, v in core.startup_timings.items() if k != "per_rank"}
        num_blocks = core.kv_cache_config.num_blocks
    if device == "cuda":
        # The uni backend's worker lived in this process: hand its cache back to the
        # driver, so that the next engine's profile sees the device as it was.
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        memory += f"; after shutdown {(total - free) / 2**30:.2f} GiB"
    if alive(pids):
        raise SmokeFailure(f"tp={tp}: worker processes {alive(pids)} outlived shutdown")
    if ipc_dir is not None and os.path.exists(ipc_dir):
        raise SmokeFailure(f"tp={tp}: IPC directory {ipc_dir} left behind: {os.listdir(ipc_dir)}")
    print(f"tp={tp} backend={backend} device={device} num_blocks={num_blocks} {memory} startup={timings}", flush=True)
    return generated, timings


def run_torchrun(model: str, device: str, tp: int, work: Path, options: dict[str, Any]) -> list[list[int]]:
    """This script under `torchrun --nproc-per-node tp` (one node, loopback rendezvous);
    every rank's tokens must agree. Returns rank 0's."""
    out_dir, run_tmp = work / "torchrun-out", work / "torchrun-tmp"
    out_dir.mkdir()
    run_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(run_tmp)}
    if device == "cpu" or options["communicator"] == "gloo":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: keep gloo on loopback
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(tp),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(Path(__file__).resolve()), "--torchrun-rank", model, str(out_dir), "--device", device,
           "--tp-communicator", options["communicator"],
           "--gpu-memory-utilization", str(options["gpu_memory_utilization"])]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SmokeFailure(f"torchrun exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(tp)]
    if alive([r["pid"] for r in results]):
        raise SmokeFailure(f"torchrun ranks {alive([r['pid'] for r in results])} outlived torchrun")
    left = sorted(n for n in os.listdir(run_tmp) if not n.startswith(TORCHRUN_OWN_TMP_PREFIX))
    if left:
        raise SmokeFailure(f"torchrun ranks left in their TMPDIR: {left}")
    for r in results[1:]:
        if r["tokens"] != results[0]["tokens"] or r["num_blocks"] != results[0]["num_blocks"]:
            raise SmokeFailure(f"torchrun rank {r['rank']} differs from rank 0: {r} vs {results[0]}")
    return results[0]["tokens"]


def torchrun_rank_main(model: str, out_dir: str, device: str, options: dict[str, Any]) -> int:
    """One rank under torchrun: generate with the external launcher, write the result."""
    from engine.core import EngineCore

    tp = int(os.environ["WORLD_SIZE"])
    with EngineCore(tensor_parallel_size=tp, distributed_executor_backend="external_launcher",
                    **engine_kwargs(model, device, **options)) as core:
        result = {"rank": core.model_executor.rank, "pid": os.getpid(), "tokens": generate(core)[0],
                  "num_blocks": core.kv_cache_config.num_blocks}
    Path(out_dir, f"rank{result['rank']}.json").write_text(json.dumps(result))
    return 0


def smoke(args: argparse.Namespace, phases: dict[str, float], facts: dict[str, Any]) -> None:
    import torch  # here, not at the top: --help loads no torch

    from engine.tiny_model import make_tiny_model

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    gpus = torch.cuda.device_count() if cuda else 0
    if gpus == 1:  # the ranks share the one GPU: NCCL cannot put two on a device
        tp, communicator = args.gpu_tp, "gloo"
    else:
        tp, communicator = (gpus, "nccl") if cuda else (args.cpu_tp, "auto")
    options = dict(communicator=communicator, gpu_memory_utilization=args.gpu_memory_utilization)
    facts.update(device=device, tp=tp)
    if cuda:
        facts["communicator"] = communicator
        print("GPUs: " + "; ".join(torch.cuda.get_device_name(i) for i in range(gpus)), flush=True)
    shm_before, tmp_before = shm_names(), our_tmp_entries(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="smoke-"))
    try:
        start = time.perf_counter()
        model = args.model
        if model is None:
            heads = 8 if tp <= 8 else tp
            # On CUDA, bfloat16 weights spread wider (init_std 0.1): peaked logits, few near-ties.
            dtype_spec = dict(dtype="bfloat16", init_std=0.1) if cuda else dict(dtype="float32")
            model = str(make_tiny_model(work / "model", "llama", hidden_size=256, num_attention_heads=heads,
                                        num_key_value_heads=max(1, heads // 4), intermediate_size=512,
                                        vocab_size=1024, with_tokenizer=False, **dtype_spec))
        phases["model"] = time.perf_counter() - start

        start = time.perf_counter()
        (reference, reference_logprobs), _ = run_engine(model, device, 1, "uni", options)
        phases["tp1"] = time.perf_counter() - start
        facts["tokens"] = sum(len(t) for t in reference)

        tp_tokens = reference
        if tp > 1:
            start = time.perf_counter()
            (tp_tokens, _), timings = run_engine(model, device, tp, "mp", options)
            phases[f"tp{tp}"] = time.perf_counter() - start
            facts["ready_s"] = timings["total"]
            compare(f"tp={tp} vs tp=1", tp_tokens, reference, reference_logprobs)

        if not args.no_torchrun:
            start = time.perf_counter()
            compare(f"torchrun tp={tp} vs tp={tp}", run_torchrun(model, device, tp, work, options), tp_tokens)
            phases["torchrun"] = time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)
    start = time.perf_counter()
    leaked_shm = shm_names() - shm_before
    deadline = time.monotonic() + 5.0  # another run's segment lives only until its ranks attach
    while leaked_shm and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked_shm &= shm_names()
    if leaked_shm:
        raise SmokeFailure(f"shared-memory segments left in /dev/shm: {sorted(leaked_shm)}")
    leaked_tmp = our_tmp_entries(tempfile.gettempdir()) - tmp_before
    if leaked_tmp:
        raise SmokeFailure(f"left in {tempfile.gettempdir()}: {sorted(leaked_tmp)}")
    phases["leaks"] = time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint dir; default: a generated tiny llama")
    parser.add_argument("--cpu-tp", type=int, default=2, help="TP size on a host without CUDA (default 2)")
    parser.add_argument("--gpu-tp", type=int, default=2,
                        help="TP size on a host with one GPU, its ranks sharing it through gloo (default 2)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                        help=f"on CUDA, the engines' share of each GPU (default {DEFAULT_GPU_MEMORY_UTILIZATION})")
    parser.add_argument("--no-torchrun", action="store_true", help="skip the torchrun (external launcher) phase")
    parser.add_argument("--torchrun-rank", nargs=2, metavar=("MODEL", "OUT_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)  # with --torchrun-rank
    parser.add_argument("--tp-communicator", default="auto", help=argparse.SUPPRESS)  # with --torchrun-rank
    args = parser.parse_args()
    if args.torchrun_rank:
        options = dict(communicator=args.tp_communicator, gpu_memory_utilization=args.gpu_memory_utilization)
        return torchrun_rank_main(*args.torchrun_rank, args.device, options)

    phases: dict[str, float] = {}
    facts: dict[str, Any] = {}
    start = time.perf_counter()
    failure = None
    try:
        smoke(args, phases, facts)
    except Exception as e:  # noqa: BLE001 - every failure ends in the summary line and exit 1
        failure = f"{type(e).__name__}: {e}"
    phases["total"] = time.perf_counter() - start
    timing = " | ".join(f"{name} {seconds:.1f}s" for name, seconds in phases.items())
    where = f"device={facts.get('device')} tp={facts.get('tp')} tokens={facts.get('tokens')}"
    if "communicator" in facts:  # CUDA only
        where += f" communicator={facts['communicator']} dtype=bfloat16 kv=profiled"
    if failure is not None:
        print(failure, flush=True)
        print(f"SMOKE FAIL {where} | {timing}", flush=True)
        return 1
    print(f"SMOKE OK {where} | {timing}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
