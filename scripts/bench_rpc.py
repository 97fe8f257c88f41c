#!/usr/bin/env python3
"""Benchmark: collective_rpc latency and 1 MiB throughput against a raw ZeroMQ REQ/REP round trip.

Usage: ``python scripts/bench_rpc.py [--calls 2000] [--tp 1 2 4] [--profile] [--spin-sweep] [--step-messages]``

What is timed, in this one run:

- baseline: a raw ZeroMQ REQ/REP round trip to one child process (a REP socket on ipc://
  in a private temp dir) with the same message sizes as a no-op RPC (the encoded
  RPCRequest out, the encoded RPCReply back); and 1 MiB requests (small replies). It is
  measured in blocks interleaved with ours at each TP size (the REP child idles in a
  blocking recv meanwhile), so background load hits both alike.
- ours: ``EngineCore(..., distributed_executor_backend="mp")`` at each TP size (one worker
  process per rank, also at TP=1); per-call latency of ``collective_rpc("check_health")``
  (a Worker method by name), of a cloudpickled no-op callable, and of "check_health" with
  ``unique_reply_rank=0``; median and p99 over ``--calls`` calls after a warm-up.
- throughput: ``collective_rpc(fn, args=(one_MiB_bytes,))`` where ``fn`` returns
  ``len(data)``, at TP 1/2: MiB/s (payload bytes sent per second, counted once per call
  even though every rank reads it) and msgs/s.

Target: no-op collective_rpc at TP=2 <= 2x the raw REQ/REP round trip (medians).

``--profile`` adds a cProfile of the engine side of ``collective_rpc("check_health")`` at
TP=2. ``--spin-sweep`` re-measures TP=2 latency with other values of the MessageQueue's
reader spin budget (``executor.message_queue._SPIN_S``), set in the engine process and, by
an RPC, in every worker: a diagnostic only, the library default is restored afterwards.
``--step-messages`` (alone, no engine): what a step's messages cost to encode and decode,
against the pickling before msgspec (scripts/bench_rpc_step_messages.py).
Never part of the test suite's pass/fail.
"""

from __future__ import annotations

# Light module-level imports: the spawned REP child re-imports this file as __mp_main__.
import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench_common import latencies, load_average, us  # noqa: E402  (path set up above)

TARGET_RATIO = 2.0
MIB = 1 << 20
ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=256)
STOP = b"__stop__"


# ---------------------------------------------------------------------------- RPC bodies (run in workers)

def noop(worker):  # noqa: ANN001, ANN201 - cloudpickled by value (defined in __main__)
    return None


def nbytes(worker, data):  # noqa: ANN001, ANN201
    return len(data)


def set_spin(worker, seconds):  # noqa: ANN001, ANN201
    import executor.message_queue as mq

    old = mq._SPIN_S
    mq._SPIN_S = seconds
    return old


# ---------------------------------------------------------------------------- raw ZeroMQ baseline

def _rep_server(addr: str, reply_size: int) -> None:  # runs in a spawned child
    import zmq

    sock = zmq.Context.instance().socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    reply = b"r" * reply_size
    while True:
        msg = sock.recv(copy=False)
        sock.send(reply)
        if msg.bytes == STOP:
            break
    sock.close()


class RawZmq:
    """A REQ socket in this process talking to a REP child on ipc:// (private temp dir)."""

    def __init__(self, reply_size: int) -> None:
        import multiprocessing as mp

        import zmq

        self._dir = tempfile.mkdtemp(prefix="tp-bench-rpc-")
        addr = f"ipc://{os.path.join(self._dir, 'rep')}"
        self._proc = mp.get_context("spawn").Process(target=_rep_server, args=(addr, reply_size), daemon=True)
        self._proc.start()
        self._sock = zmq.Context.instance().socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(addr)  # asynchronous: the first send waits for the child to bind

    def roundtrip(self, msg: bytes) -> None:
        self._sock.send(msg, copy=len(msg) < 65536)
        self._sock.recv(copy=False)

    def close(self) -> None:
        import shutil

        try:
            self.roundtrip(STOP)
        finally:
            self._sock.close()
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
            shutil.rmtree(self._dir, ignore_errors=True)


# ---------------------------------------------------------------------------- measuring

def stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return dict(median=statistics.median(s), p99=s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))],
                mean=statistics.fmean(s), min=s[0], max=s[-1], over_50ms=sum(x > 0.05 for x in s))


def throughput(fn, payload_bytes: int, min_calls: int, min_s: float, warmup: int) -> tuple[float, float]:  # noqa: ANN001
    """(MiB/s, msgs/s) of `fn()` run back to back for at least `min_calls` calls and `min_s` s."""
    for _ in range(warmup):
        fn()
    n, start = 0, time.perf_counter()
    while n < min_calls or time.perf_counter() - start < min_s:
        fn()
        n += 1
    elapsed = time.perf_counter() - start
    return n * payload_bytes / MIB / elapsed, n / elapsed


# ---------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="tensor-parallel sizes for latency")
    p.add_argument("--tput-tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes for throughput")
    p.add_argument("--calls", type=int, default=2000, help="timed calls per latency measurement")
    p.add_argument("--blocks", type=int, default=10, help="interleaved blocks per latency measurement")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls before each latency measurement")
    p.add_argument("--tput-calls", type=int, default=200, help="min 1 MiB calls per throughput measurement")
    p.add_argument("--tput-seconds", type=float, default=2.0, help="min seconds per throughput measurement")
    p.add_argument("--model", default=None, help="checkpoint dir (default: a cached tiny llama)")
    p.add_argument("--profile", action="store_true", help="cProfile the engine side at TP=2")
    p.add_argument("--spin-sweep", action="store_true", help="TP=2 latency vs the MessageQueue spin budget")
    p.add_argument("--step-messages", action="store_true", help="only a step's encode + decode, new vs pickle")
    args = p.parse_args()
    if args.step_messages:
        from bench_rpc_step_messages import step_messages

        return step_messages(args.calls, args.warmup, args.blocks)

    import cloudpickle
    from bench_startup import tiny_model_dir

    from engine import EngineConfig
    from engine.core import EngineCore
    from executor.rpc import RPCReply, RPCRequest
    from executor.serial_utils import encode_message

    wall = time.perf_counter()
    model = args.model or tiny_model_dir()
    print(f"bench_rpc: model={model}")
    print(f"host: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, load average at start {load_average()}")
    print(f"latency: {args.calls} timed calls after {args.warmup} warm-up calls; "
          f"engine: distributed_executor_backend='mp', start method "
          f"{os.environ.get('TP_WORKER_MULTIPROC_METHOD', 'forkserver')}\n")

    # Message sizes of a no-op RPC, as the MessageQueue encodes them.
    req_name = len(encode_message(RPCRequest(12345, "check_health", (), {}, None)))
    req_fn = len(encode_message(RPCRequest(12345, cloudpickle.dumps(noop), (), {}, None)))
    reply_size = len(encode_message(RPCReply(12345, 0, True, result=True)))
    blob = os.urandom(MIB)
    req_mib = len(encode_message(RPCRequest(12345, cloudpickle.dumps(nbytes), (blob,), {}, None)))

    # Other users' load on a small host swings within seconds, so the raw baseline is
    # measured in blocks interleaved with ours, per TP size, and each ratio uses the raw
    # numbers taken alongside it.
    kinds = {"name": lambda rpc: rpc("check_health"), "callable": lambda rpc: rpc(noop),
             "name, unique_reply_rank=0": lambda rpc: rpc("check_health", unique_reply_rank=0)}
    raw_msg_name, raw_msg_fn = b"q" * req_name, b"q" * req_fn
    blocks = max(1, args.blocks)
    per_block = max(1, args.calls // blocks)
    raw = RawZmq(reply_size)
    lat: dict[int, dict[str, dict[str, float]]] = {}
    raw_lat: dict[int, dict[str, dict[str, float]]] = {}
    tput: dict[int, tuple[float, float]] = {}
    raw_tput: dict[int, tuple[float, float]] = {}
    profile_text = ""
    sweep: list[tuple[float, dict[str, float]]] = []
    try:
        for _ in range(args.warmup):
            raw.roundtrip(raw_msg_name)
        for tp in sorted(set(args.tp) | set(args.tput_tp)):
            core = EngineCore(EngineConfig(model=model, tensor_parallel_size=tp, distributed_executor_backend="mp",
                                           **ENGINE_KW))
            try:
                rpc = core.collective_rpc
                if tp in args.tp:
                    for fn in kinds.values():
                        for _ in range(args.warmup):
                            fn(rpc)
                    samples: dict[str, list[float]] = {k: [] for k in ("raw", "raw_fn", *kinds)}
                    for _ in range(blocks):
                        samples["raw"] += latencies(lambda: raw.roundtrip(raw_msg_name), per_block, 0)
                        samples["raw_fn"] += latencies(lambda: raw.roundtrip(raw_msg_fn), per_block, 0)
                        for kind, fn in kinds.items():
                            samples[kind] += latencies(lambda: fn(rpc), per_block, 0)
                    lat[tp] = {k: stats(samples[k]) for k in kinds}
                    raw_lat[tp] = {"name": stats(samples["raw"]), "callable": stats(samples["raw_fn"])}
                if tp in args.tput_tp:
                    def one_mib() -> None:
                        assert rpc(nbytes, args=(blob,)) == [MIB] * tp

                    half = args.tput_seconds / 2
                    r1 = throughput(lambda: raw.roundtrip(blob), MIB, args.tput_calls // 2, half, 10)
                    o1 = throughput(one_mib, MIB, args.tput_calls // 2, half, 10)
                    r2 = throughput(lambda: raw.roundtrip(blob), MIB, args.tput_calls // 2, half, 0)
                    o2 = throughput(one_mib, MIB, args.tput_calls // 2, half, 0)
                    tput[tp] = ((o1[0] + o2[0]) / 2, (o1[1] + o2[1]) / 2)
                    raw_tput[tp] = ((r1[0] + r2[0]) / 2, (r1[1] + r2[1]) / 2)
                if tp == 2 and args.profile:
                    profile_text = profile_engine_side(rpc, args.calls, args.warmup)
                if tp == 2 and args.spin_sweep:
                    sweep = spin_sweep(rpc, args.calls, args.warmup)
            finally:
                core.shutdown()
            print(f"  TP={tp} done ({time.perf_counter() - wall:.0f}s, load {load_average()})", flush=True)
    finally:
        raw.close()

    # ---- report
    print(f"\nNo-op round-trip latency (microseconds; {blocks} blocks of {per_block} calls per row, raw and ours "
          f"interleaved). Message sizes: request {req_name} B (by name) / {req_fn} B (callable), "
          f"reply {reply_size} B per rank")
    print(f"{'what':<52}{'median':>9}{'p99':>9}{'mean':>9}{'min':>9}{'x raw med':>11}")

    def row(label: str, s: dict[str, float], ref: float) -> None:
        print(f"{label:<52}{us(s['median']):>9}{us(s['p99']):>9}{us(s['mean']):>9}{us(s['min']):>9}"
              f"{s['median'] / ref:>10.2f}x")

    for tp, kinds_stats in lat.items():
        raw_name, raw_fn = raw_lat[tp]["name"], raw_lat[tp]["callable"]
        row(f"  raw ZeroMQ REQ/REP, {req_name} B out (with TP={tp})", raw_name, raw_name["median"])
        row(f"  raw ZeroMQ REQ/REP, {req_fn} B out (with TP={tp})", raw_fn, raw_fn["median"])
        for kind, st in kinds_stats.items():
            ref = raw_fn["median"] if kind == "callable" else raw_name["median"]
            row(f"collective_rpc TP={tp}: {kind}", st, ref)

    if 2 in lat:
        print(f"\nTarget: no-op collective_rpc at TP=2 <= {TARGET_RATIO:.1f}x the raw REQ/REP round trip (median)")
        for kind in ("name", "callable"):
            ours, ref = lat[2][kind], raw_lat[2][kind]
            ratio = ours["median"] / ref["median"]
            verdict = "PASS" if ratio <= TARGET_RATIO else "MISS"
            print(f"  {kind:<9}: {us(ours['median']).strip()} us vs raw {us(ref['median']).strip()} us "
                  f"= {ratio:.2f}x  {verdict}   (p99: {ours['p99'] / ref['p99']:.2f}x)")

    print(f"\n1 MiB messages (request {req_mib} B; reply = len(data) per rank; raw and ours interleaved)")
    print(f"{'what':<52}{'MiB/s':>10}{'msgs/s':>10}{'ms/msg':>10}{'x raw':>8}")
    for tp, (mibs, msgs) in tput.items():
        rm, rn = raw_tput[tp]
        print(f"{'  raw ZeroMQ REQ/REP, 1 MiB out (with TP=' + str(tp) + ')':<52}{rm:>10.1f}{rn:>10.1f}"
              f"{1e3 / rn:>10.2f}{1.0:>7.2f}x")
        print(f"{'collective_rpc TP=' + str(tp) + ': fn(worker, 1 MiB bytes)':<52}{mibs:>10.1f}{msgs:>10.1f}"
              f"{1e3 / msgs:>10.2f}{mibs / rm:>7.2f}x")

    if sweep:
        print("\nSpin sweep at TP=2 (executor.message_queue._SPIN_S in the engine and every worker; "
              "'check_health' by name; microseconds)")
        print(f"{'_SPIN_S':>10}{'median':>9}{'p99':>9}{'mean':>9}{'x raw med':>11}{'max ms':>9}{'calls>50ms':>11}")
        base = raw_lat[2]["name"]["median"]
        for spin, st in sweep:
            print(f"{spin:>10.0e}{us(st['median']):>9}{us(st['p99']):>9}{us(st['mean']):>9}{st['median'] / base:>10.2f}x"
                  f"{st['max'] * 1e3:>9.1f}{st['over_50ms']:>11}")
    if profile_text:
        print("\ncProfile of the engine side, collective_rpc('check_health') at TP=2 "
              f"({args.calls} calls; sorted by tottime)")
        print(profile_text)
    print(f"load average at end {load_average()}; wall time {time.perf_counter() - wall:.0f}s")


def profile_engine_side(rpc, calls: int, warmup: int) -> str:  # noqa: ANN001
    import cProfile
    import io
    import pstats

    for _ in range(warmup):
        rpc("check_health")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        rpc("check_health")
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(18)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    return "\n".join(ln for ln in lines if not ln.startswith("   Ordered by") and "Random listing" not in ln)


def spin_sweep(rpc, calls: int, warmup: int) -> list[tuple[float, dict[str, float]]]:  # noqa: ANN001
    import executor.message_queue as mq

    default = mq._SPIN_S
    out = []
    try:
        for spin in (0.0, 5e-5, default, 2e-3, 1e-2):
            mq._SPIN_S = spin
            rpc(set_spin, args=(spin,))
            out.append((spin, stats(latencies(lambda: rpc("check_health"), calls, warmup))))
    finally:
        mq._SPIN_S = default
        rpc(set_spin, args=(default,))
    return out


if __name__ == "__main__":
    main()
