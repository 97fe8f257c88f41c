"""What the benchmark scripts share. The load benchmarks (bench_load.py,
bench_loaders.py): the cached checkpoint, the measurement of one load region, the TP=2
gloo world of a child, the comma-separated case list. Every script that measures in
child processes (those two, bench_ray.py, bench_startup.py): the child's one
`RESULT {json}` line and reading it back. The scripts that start servers
(bench_online_vs_vllm.py, bench_prefix_cache.py, bench_torchrun_startup.py,
soak_server.py) take a free port and `die_with_parent` from here.

Imported by bare name from its sibling scripts (`python scripts/bench_x.py` puts
scripts/ first on sys.path); this module puts the repository root there too. Not a
script of its own: `python scripts/bench_common.py --help` prints this text.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from executor.parent_death import set_parent_death_signal  # noqa: E402

GB = 1e9
PAGE = 4096
RESULT_PREFIX = "RESULT "


# --------------------------------------------------------------------------- checkpoint


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def weight_bytes(model_dir: Path) -> int:
    """Sum of tensor byte sizes from the safetensors headers (not the file sizes)."""
    total = 0
    for path in weight_files(model_dir):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        header.pop("__metadata__", None)
        total += sum(end - begin for begin, end in (v["data_offsets"] for v in header.values()))
    return total


def ensure_checkpoint(root: Path, spec: dict[str, Any]) -> Path:
    """Generate the checkpoint unless an identical one is already cached."""
    tag = "llama-h{hidden_size}-l{num_hidden_layers}-v{vocab_size}-s{num_shards}-{dtype}".format(**spec)
    model_dir = root / tag
    marker = model_dir / "bench_spec.json"
    if marker.is_file() and json.loads(marker.read_text()) == spec and weight_files(model_dir):
        return model_dir
    from engine.tiny_model import make_tiny_model

    print(f"generating {model_dir} ...", flush=True)
    t0 = time.perf_counter()
    kwargs = dict(spec)
    make_tiny_model(model_dir, kwargs.pop("arch"), with_tokenizer=False, seed=0, **kwargs)
    marker.write_text(json.dumps(spec))
    print(f"  done in {time.perf_counter() - t0:.1f}s", flush=True)
    return model_dir


def plain_read(files: list[Path], buffer: bytearray) -> int:
    """Read every file through one reused `buffer` (the read-rate ceiling); returns the bytes read."""
    view = memoryview(buffer)
    total = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    return total


def warm_page_cache(files: list[Path]) -> None:
    plain_read(files, bytearray(64 << 20))


# --------------------------------------------------------------------------- measuring (child side)


def _vm_hwm_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_vm_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Meter:
    """Wall time, peak RSS growth, bytes read (rchar) and page faults of one region."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self._stop = threading.Event()
        self.sampled_peak = 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss = self.proc.memory_info().rss
            if rss > self.sampled_peak:
                self.sampled_peak = rss
            time.sleep(0.001)

    def __enter__(self) -> "Meter":
        gc.collect()
        self.hwm_reset = _reset_vm_hwm()
        self.rss0 = self.proc.memory_info().rss
        self.sampled_peak = self.rss0
        io = self.proc.io_counters()
        self.rchar0, self.read_bytes0 = io.read_chars, io.read_bytes
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.minflt0, self.majflt0 = ru.ru_minflt, ru.ru_majflt
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self.sampler.join()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        io = self.proc.io_counters()
        hwm = _vm_hwm_bytes() if self.hwm_reset else None
        ru_maxrss = ru.ru_maxrss * 1024
        self.peak = hwm if hwm is not None else max(self.sampled_peak, ru_maxrss)
        self.result = {
            "seconds": self.seconds,
            "rss_before": self.rss0,
            "peak_growth": self.peak - self.rss0,
            "sampled_peak_growth": self.sampled_peak - self.rss0,
            "peak_source": "VmHWM" if hwm is not None else "sampler/ru_maxrss",
            "rchar": io.read_chars - self.rchar0,
            "read_bytes": io.read_bytes - self.read_bytes0,
            "minflt": ru.ru_minflt - self.minflt0,
            "majflt": ru.ru_majflt - self.majflt0,
        }


def touch_all(tensors: Any) -> int:
    """Read one byte of every page of every tensor, so that all of them are resident. A
    CPU weight packed in place (models/layers/packed_tensor.py) is read in its packed
    layout, which is what it holds: reading it as a tensor would unpack it."""
    import ctypes

    import torch

    total = 0
    for t in tensors:
        packed = getattr(t, "packed_weight", None)
        if packed is not None:
            t = packed.packed
            if t.is_mkldnn:
                nbytes = torch.ops.mkldnn._nbytes(t)
                buffer = (ctypes.c_uint8 * nbytes).from_address(torch.ops.mkldnn.data_ptr(t))
                total += int(torch.frombuffer(buffer, dtype=torch.uint8)[::PAGE].sum())
                continue
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        raw = flat.view(torch.uint8)
        total += int(raw[:: PAGE].sum())
    return total


def param_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def join_tp_group(rank: int, world_size: int, port: int) -> None:
    """Join the children's gloo world on 127.0.0.1:`port` as TP rank `rank` (before the clock)."""
    import torch

    from distributed import init_distributed_environment

    init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", torch.device("cpu"))


def leave_tp_group() -> None:
    import torch.distributed as dist

    from distributed import destroy_distributed_environment

    dist.barrier()
    destroy_distributed_environment()


# --------------------------------------------------------------------------- orchestration (parent side)


def die_with_parent() -> None:
    """A `preexec_fn` for a server a script starts: the server gets SIGTERM when the
    script dies, however it dies (a harness's timeout kills with SIGKILL), so that no
    server outlives its run; it stops on SIGTERM, its workers with it."""
    set_parent_death_signal(signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """This environment with the repository on PYTHONPATH, plus `extra`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.update(extra)
    return env


def parse_result(out: str, err: str, code: int, what: str) -> dict[str, Any]:
    """The `RESULT {json}` line a child printed (`print_result`) in its stdout `out`.
    Raises RuntimeError, naming `what` and the exit `code`, with the ends of `out` and
    `err`, for a child that printed none."""
    for line in out.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"{what} failed (exit {code}):\n{out[-3000:]}\n{err[-5000:]}")


def run_children(cmds: list[list[str]], what: str, env: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    """Run `cmds` at once (one per rank) and return each one's RESULT, in order. Raises
    RuntimeError, with the child's output, for one that printed none; every child is
    killed before this returns."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for cmd in cmds]
    results = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout)
            results.append(parse_result(out, err, p.returncode, what if len(procs) == 1 else f"{what} rank {rank}"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def print_result(result: dict[str, Any]) -> None:
    """A child's one line, for `run_children` or `parse_result`."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def median_run(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The repeat whose (slowest-rank) time is the median."""
    ordered = sorted(runs, key=lambda r: max(x["seconds"] for x in r))
    return ordered[(len(ordered) - 1) // 2]


def load_average() -> str:
    """The host's 1, 5 and 15 minute load averages, for a benchmark's header ("n/a" where
    the OS has none): a busy host explains a slow run."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def comma_list(parser: argparse.ArgumentParser, text: str, allowed: list[str], what: str) -> list[str]:
    """The items of a comma-separated flag value; `parser.error` (exit 2) names any not in
    `allowed` (`what`: the items' name in that message, e.g. "case")."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = sorted(set(items) - set(allowed))
    if unknown:
        parser.error(f"unknown {what}(s) {unknown}; choose from {allowed}")
    return items


def add_child_args(parser: argparse.ArgumentParser) -> None:
    """The hidden flags of a script's child mode (the command `run_children` starts):
    --child CASE, and the TP rank and gloo port of a TP=2 case (`join_tp_group`)."""
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)


if __name__ == "__main__":
    print(__doc__)


def latencies(fn: Callable[[], object], calls: int, warmup: int) -> list[float]:
    """Per-call seconds of `fn()` over `calls` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t = clock()
        fn()
        out.append((clock() - t) * 1e-9)
    return out


def us(seconds: float) -> str:
    """Seconds as microseconds, right-aligned for a table."""
    return f"{seconds * 1e6:8.1f}"
