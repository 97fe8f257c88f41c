"""A measurement that has the machine alone and is held while its memory is read.

Child side (`serve_held`): the workload comes in on stdin, the result goes out as one
`RESULT {json}` line, and the child then stays up, its engine still running, until
released. Parent side (`run_held_child`): sends the workload, reads the RESULT, reads
the resident memory of the pids the child names (`proc_memory`: /proc/<pid>/status) at
that steady state, with the model and the KV cache still held, then releases the child.

The child side is standard library only: the children of bench_vs_llamacpp.py and
bench_moe.py import this module from our venv and from the peers' venvs (llama.cpp's
has neither torch nor our package). The parent side imports bench_common (and with it
our package) only when called.

`random_prompts` makes the prompts of both scripts' workloads.
`measure_decode(generate, workload)` is the one measurement both sides of
bench_vs_llamacpp.py run, through each engine's own `generate(prompts, max_tokens) ->
token id lists`: batch-1 decode speed as (t(max_tokens new) - t(1 new)) / (max_tokens -
1), which leaves the prefill and any per-request overhead out on both sides alike, and
the throughput of `concurrent` requests submitted at once, prefill included.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

RESULT_PREFIX = "RESULT "  # as bench_common.print_result writes it: parse_result reads it back

Generate = Callable[[list[list[int]], int], list[list[int]]]


# --------------------------------------------------------------------------- child side


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` random token ids, never the special ids 0-3: every side of
    a comparison gets the same ones."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


IDLE_LINE = "idle"  # parent -> child: go idle as a server would, then answer IDLE_DONE
IDLE_DONE = "IDLE"


def serve_held(run: Callable[..., None]) -> None:
    """Read the workload (one JSON line on stdin) and call `run(workload, hold)`, which
    measures and then, still holding its model and cache, calls `hold(result, idle=None)`
    once: that prints the RESULT line and blocks until the parent writes the release
    line (or closes stdin). The parent may first write IDLE_LINE: the child then runs
    `idle` (what its server does once idle: ours hands the heap's free pages back),
    answers IDLE_DONE and waits for the release line. Raises RuntimeError if `run`
    returns without calling `hold`."""
    workload = json.loads(sys.stdin.readline())
    held = []

    def hold(result: dict, idle: Callable[[], object] | None = None) -> None:
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        if sys.stdin.readline().strip() == IDLE_LINE:
            if idle is not None:
                idle()
            print(IDLE_DONE, flush=True)
            sys.stdin.readline()
        held.append(True)

    run(workload, hold)
    if not held:
        raise RuntimeError("the measurement returned without reporting a result")


def timed(generate: Generate, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds of one `generate` call and its outputs; raises RuntimeError for an output
    that is not exactly `max_tokens` long (EOS must be ignored on both sides, or the two
    would not do the same work)."""
    start = time.perf_counter()
    outputs = generate(prompts, max_tokens)
    seconds = time.perf_counter() - start
    lengths = sorted({len(o) for o in outputs})
    if len(outputs) != len(prompts) or lengths != [max_tokens]:
        raise RuntimeError(f"asked for {len(prompts)} x {max_tokens} tokens, got {len(outputs)} outputs of {lengths}")
    return seconds, outputs


def measure_decode(generate: Generate, workload: dict) -> dict:
    """Batch-1 decode and concurrent throughput (see the module docstring). `workload`:
    `prompts` (batch-1 prompts, at least 2, all of one length; the first only warms up),
    `concurrent_prompts`, `max_tokens`. Each batch-1 time is the best over the prompts
    after the first."""
    prompts, max_tokens = workload["prompts"], workload["max_tokens"]
    # Warm-up, untimed: first-call allocations, thread pools, per-shape kernel choices,
    # for every batch shape measured below.
    timed(generate, prompts[:1], 1)
    timed(generate, prompts[:1], max_tokens)
    timed(generate, workload["concurrent_prompts"], 2)
    prefill = min(timed(generate, [p], 1)[0] for p in prompts[1:])
    runs = [timed(generate, [p], max_tokens) for p in prompts[1:]]
    full = min(seconds for seconds, _ in runs)
    concurrent_s, _ = timed(generate, workload["concurrent_prompts"], max_tokens)
    n = len(workload["concurrent_prompts"])
    return {
        "prefill_s": prefill,
        "batch1_s": full,
        # NaN where noise swamps the decode time (a tiny model on a busy machine)
        "batch1_decode_tok_s": (max_tokens - 1) / (full - prefill) if full > prefill else float("nan"),
        "batch1_end_to_end_tok_s": max_tokens / full,
        "batch1_tokens": runs[0][1][0],  # the same prompt's greedy tokens on every side
        "concurrent_s": concurrent_s,
        "concurrent_tok_s": n * max_tokens / concurrent_s,
    }


# --------------------------------------------------------------------------- parent side


def proc_memory(pid: int) -> dict[str, int]:
    """Resident memory of process `pid` in bytes, from /proc/<pid>/status: `rss` (VmRSS),
    `anon` (RssAnon: what the process allocated), `file` (RssFile: mapped file pages,
    such as an mmapped checkpoint, which the page cache can drop and refill) and `shmem`
    (RssShmem). Zeros where the kernel reports none (not Linux: every field 0)."""
    fields = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    memory = dict.fromkeys(fields.values(), 0)
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            parts = line.split()  # "VmRSS:", "1234", "kB"
            if parts and parts[0] in fields:
                memory[fields[parts[0]]] = int(parts[1]) * 1024
    except OSError:
        pass
    return memory


def largest_processes(count: int, root: int | None = None) -> list[int]:
    """The `count` processes of `root`'s tree (default this process: itself and every
    descendant, from /proc/<pid>/task/<tid>/children) with the largest resident memory: a
    peer's ranks, whatever its process layout. Standard library only, so a child runs it
    in any venv."""
    tree, todo = [], [os.getpid() if root is None else root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return sorted(tree, key=lambda pid: proc_memory(pid)["rss"], reverse=True)[:count]


class HeldChildError(RuntimeError):
    """A `run_held_child` child that printed no RESULT: the message has the ends of its
    output, `stderr` all of its standard error (a native crash's report is near its top)."""

    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(message)
        self.stderr = stderr


def run_held_child(cmd: list[str], workload: dict[str, Any], env: dict[str, str], timeout: float,
                   what: str, idle_s: float | None = None) -> tuple[dict[str, Any], dict[int, dict[str, int]]]:
    """Run a bench_held.serve_held child alone: send it `workload`, read its RESULT,
    read the resident memory (`proc_memory`) of the pids it names in `rank_pids` (default:
    its own) while it still holds everything, then release it. With `idle_s`, before the
    release: the child goes idle as its server would (serve_held's `idle`), then after
    `idle_s` more seconds the memory is read again, as `idle_<key>` beside each key.
    Returns (result, memory per pid). Raises HeldChildError, naming `what` with the ends
    of the child's output, for a child that printed no RESULT within `timeout` s; the
    child is gone when this returns (it also dies with this process: `die_with_parent`)."""
    from bench_common import REPO, die_with_parent, parse_result  # our package: the parent side only

    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                cwd=REPO, preexec_fn=die_with_parent)
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        out: list[str] = []
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(workload) + "\n")
            proc.stdin.flush()
            for line in proc.stdout:
                out.append(line)
                if line.startswith(RESULT_PREFIX):
                    break
            watchdog.cancel()
            err.seek(0)
            stderr = err.read()
            try:
                result = parse_result("".join(out), stderr, proc.poll() or 0, what)
            except RuntimeError as e:
                raise HeldChildError(str(e), stderr) from None
            memory = {pid: proc_memory(pid) for pid in result.get("rank_pids") or [proc.pid]}
            if idle_s is not None:
                proc.stdin.write(IDLE_LINE + "\n")
                proc.stdin.flush()
                watchdog = threading.Timer(timeout, proc.kill)
                watchdog.start()
                if not any(line.strip() == IDLE_DONE for line in proc.stdout):
                    raise HeldChildError(f"{what}: the child ended before going idle", "")
                watchdog.cancel()
                time.sleep(idle_s)
                for pid, held in memory.items():
                    held.update({f"idle_{key}": value for key, value in proc_memory(pid).items()})
            proc.stdin.write("\n")
            proc.stdin.close()
            proc.wait(timeout=120)
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return result, memory
