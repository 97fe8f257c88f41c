"""Tests for the message queue (owner, writer, reader): real spawned processes, real shm, real sockets."""

from __future__ import annotations

import hashlib
import math
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import psutil
import pytest

from executor.message_queue import MessageQueueHandle, MessageQueueOwner, QueueClosedError
from executor.message_queue_reader import MessageQueueReader
from executor.message_queue_writer import MessageQueueWriter

pytestmark = pytest.mark.slow

SPAWN = mp.get_context("spawn")
SMALL_CHUNK = 64 * 1024
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shm_exists(handle: MessageQueueHandle) -> bool:
    return os.path.exists(os.path.join("/dev/shm", handle.shm_name))


def _ipc_dir(handle: MessageQueueHandle) -> str:
    return os.path.dirname(handle.data_addr.removeprefix("ipc://"))


# --- stress plan, recomputed identically by the writer and every reader -------------

_POOL_BYTES = 3 * SMALL_CHUNK + 4096


def _pool(seed: int) -> bytes:
    return random.Random(seed).randbytes(_POOL_BYTES)


def _plan(seed: int, n: int) -> list[tuple[int, int]]:
    """(offset, size) per message; log-uniform sizes 0..3x chunk plus boundary cases."""
    rng = random.Random(seed + 1)
    edges = [0, 1, SMALL_CHUNK - 64, SMALL_CHUNK - 30, SMALL_CHUNK, SMALL_CHUNK + 1, 3 * SMALL_CHUNK]
    sizes = edges + [int(math.exp(rng.uniform(0, math.log(3 * SMALL_CHUNK)))) - 1 for _ in range(n - len(edges))]
    return [(rng.randrange(_POOL_BYTES - size + 1), size) for size in sizes]


def _stress_reader(handle: MessageQueueHandle, rank: int, seed: int, n: int, results: Any) -> None:
    mq = MessageQueueReader(handle, rank)
    try:
        pool = _pool(seed)
        for seq, (off, size) in enumerate(_plan(seed, n)):
            got = mq.dequeue(timeout=60)
            if got[0] != seq or got[1] != pool[off : off + size]:
                results.put((rank, f"message {seq} wrong: seq={got[0]} len={len(got[1])} want {size}"))
                return
        results.put((rank, "ok"))
    except BaseException as exc:  # report, don't just die silently
        results.put((rank, repr(exc)))
    finally:
        mq.shutdown()


@pytest.mark.timeout(180)
def test_four_readers_random_sizes_in_order() -> None:
    n_reader, n_msgs, seed = 4, 10_000, 1234
    creator = MessageQueueOwner(n_reader, max_chunk_bytes=SMALL_CHUNK, max_chunks=8)
    handle = creator.export_handle()
    results = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_stress_reader, args=(handle, rank, seed, n_msgs, results), daemon=True)
        for rank in range(n_reader)
    ]
    for p in procs:
        p.start()
    writer = MessageQueueWriter(handle)
    try:
        writer.wait_until_ready(timeout=60)
        creator.unlink()  # like the executor: everyone attached, so drop the name now
        assert not _shm_exists(handle)
        pool = _pool(seed)
        for seq, (off, size) in enumerate(_plan(seed, n_msgs)):
            writer.enqueue((seq, pool[off : off + size]), timeout=60)
        outcomes = dict(results.get(timeout=120) for _ in range(n_reader))
        assert outcomes == {rank: "ok" for rank in range(n_reader)}
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        writer.shutdown()
        creator.shutdown()
        for p in procs:
            if p.is_alive():
                p.kill()


def _digest_reader(handle: MessageQueueHandle, results: Any) -> None:
    mq = MessageQueueReader(handle, 0)
    try:
        msg = mq.dequeue(timeout=60)
        results.put((msg["tag"], len(msg["blob"]), hashlib.sha256(msg["blob"]).hexdigest()))
    finally:
        mq.shutdown()


@pytest.mark.timeout(120)
def test_message_larger_than_64_mib_round_trips() -> None:
    creator = MessageQueueOwner(1, max_chunk_bytes=1024 * 1024, max_chunks=4)
    handle = creator.export_handle()
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=_digest_reader, args=(handle, results), daemon=True)
    proc.start()
    writer = MessageQueueWriter(handle)
    try:
        blob = random.Random(7).randbytes(65 * 1024 * 1024 + 3)
        writer.enqueue({"tag": "big", "blob": blob}, timeout=60)
        assert results.get(timeout=60) == ("big", len(blob), hashlib.sha256(blob).hexdigest())
        proc.join(timeout=30)
        assert proc.exitcode == 0
    finally:
        writer.shutdown()
        creator.shutdown()
        if proc.is_alive():
            proc.kill()


@pytest.mark.timeout(60)
def test_torch_tensors_inline_and_overflow() -> None:
    torch = pytest.importorskip("torch")
    with MessageQueueOwner(1, max_chunk_bytes=64 * 1024) as creator:
        handle = creator.export_handle()
        reader = MessageQueueReader(handle, 0)
        writer = MessageQueueWriter(handle)
        small = torch.arange(100, dtype=torch.float32)
        big = torch.randn(1024, 1024)  # 4 MiB: goes over zmq
        writer.enqueue({"small": small, "big": big}, timeout=10)
        got = reader.dequeue(timeout=10)
        assert torch.equal(got["small"], small) and torch.equal(got["big"], big)
        writer.shutdown()
        reader.shutdown()


@pytest.mark.timeout(60)
def test_timeout_and_cancel_from_another_thread() -> None:
    with MessageQueueOwner(1) as creator:
        reader = MessageQueueReader(creator.export_handle(), 0)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=0.2)
        assert time.monotonic() - start >= 0.19

        outcome: list[BaseException] = []

        def blocked() -> None:
            try:
                reader.dequeue()
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=blocked, daemon=True)
        thread.start()
        time.sleep(0.3)  # past the spin phase: really blocked in poll
        assert thread.is_alive()
        reader.shutdown()
        thread.join(timeout=2)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], QueueClosedError)
        with pytest.raises(QueueClosedError):
            reader.dequeue(timeout=0)
        reader.shutdown()  # idempotent


@pytest.mark.timeout(60)
def test_writer_shutdown_drains_then_closes_readers() -> None:
    with MessageQueueOwner(2, max_chunk_bytes=1024) as creator:
        handle = creator.export_handle()
        readers = [MessageQueueReader(handle, r) for r in range(2)]
        writer = MessageQueueWriter(handle)
        writer.wait_until_ready(timeout=10)
        for i in range(3):
            writer.enqueue((i, b"x" * (i * 1000)))  # 2000 B overflows the 1 KiB chunk
        # Roles are types: the writer cannot read, nor a reader write.
        assert not hasattr(writer, "dequeue") and not hasattr(readers[0], "enqueue")
        with pytest.raises(ValueError):
            MessageQueueReader(handle, 2)
        for reader in readers:
            assert [reader.dequeue(timeout=5)[0] for _ in range(3)] == [0, 1, 2]
        writer.shutdown()
        for reader in readers:
            with pytest.raises(QueueClosedError):
                reader.dequeue(timeout=5)
            reader.shutdown()
        with pytest.raises(QueueClosedError):
            writer.enqueue("late")


@pytest.mark.timeout(60)
def test_full_ring_times_out_and_detects_a_reader_that_shut_down() -> None:
    with MessageQueueOwner(2, max_chunk_bytes=1024, max_chunks=2) as creator:
        handle = creator.export_handle()
        live, leaving = (MessageQueueReader(handle, r) for r in range(2))
        writer = MessageQueueWriter(handle)
        writer.enqueue(0, timeout=10)
        writer.enqueue(1, timeout=10)
        with pytest.raises(TimeoutError):
            writer.enqueue(2, timeout=0.2)  # nothing read yet: the ring is full
        assert live.dequeue(timeout=5) == 0
        leaving.shutdown()
        with pytest.raises(QueueClosedError, match=r"\[1\]"):
            writer.enqueue(2, timeout=10)
        assert live.dequeue(timeout=5) == 1
        live.shutdown()
        writer.shutdown()


@pytest.mark.timeout(60)
def test_unlink_shutdown_remove_segment_and_ipc_dir(tmp_path: Any) -> None:
    a, b = MessageQueueOwner(1), MessageQueueOwner(1)
    ha, hb = a.export_handle(), b.export_handle()
    assert ha.shm_name != hb.shm_name and _ipc_dir(ha) != _ipc_dir(hb)
    assert _shm_exists(ha) and os.path.isdir(_ipc_dir(ha))
    assert os.stat(_ipc_dir(ha)).st_mode & 0o777 == 0o700

    a.unlink()
    a.unlink()  # idempotent
    assert not _shm_exists(ha)
    # Same-process attach still works after unlink; existing mappings stay valid.
    writer = MessageQueueWriter(ha)
    reader = MessageQueueReader(ha, 0)
    writer.enqueue({"after": "unlink"}, timeout=10)
    assert reader.dequeue(timeout=10) == {"after": "unlink"}
    a.shutdown()
    assert not os.path.exists(_ipc_dir(ha))
    writer.shutdown()
    reader.shutdown()

    b.shutdown()
    b.shutdown()
    assert not _shm_exists(hb) and not os.path.exists(_ipc_dir(hb))

    # A caller-provided ipc dir is kept; only our socket files go.
    c = MessageQueueOwner(1, ipc_dir=str(tmp_path))
    hc = c.export_handle()
    w = MessageQueueWriter(hc)
    c.shutdown()
    w.shutdown()
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []
    assert not _shm_exists(hc)


def test_owner_that_cannot_make_its_fifos_leaves_nothing(tmp_path: Any, monkeypatch: Any) -> None:
    """The FIFOs are made after the segment: when a mkfifo fails, the segment and the
    FIFOs made before it go again, and the error is the OS's."""
    def segments() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"tpmq_{os.getpid()}_")}

    before = segments()
    with pytest.raises(FileNotFoundError):
        MessageQueueOwner(2, ipc_dir=str(tmp_path / "missing"))
    assert segments() == before

    # Reader 1's FIFO name taken already: reader 0's, made first, is removed again.
    monkeypatch.setattr("executor.message_queue.uuid.uuid4", lambda: type("U", (), {"hex": "f" * 32})())
    os.mkfifo(tmp_path / f"tpmq_{os.getpid()}_ffffffff.wake1")
    with pytest.raises(FileExistsError):
        MessageQueueOwner(2, ipc_dir=str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == [f"tpmq_{os.getpid()}_ffffffff.wake1"]
    assert segments() == before


def _idle_reader(handle: MessageQueueHandle, attached: Any, results: Any) -> None:
    mq = MessageQueueReader(handle, 0)
    attached.set()
    results.put(mq.dequeue(timeout=60))
    mq.shutdown()


@pytest.mark.timeout(60)
def test_idle_reader_uses_little_cpu() -> None:
    with MessageQueueOwner(1) as creator:
        handle = creator.export_handle()
        attached, results = SPAWN.Event(), SPAWN.Queue()
        proc = SPAWN.Process(target=_idle_reader, args=(handle, attached, results), daemon=True)
        proc.start()
        writer = MessageQueueWriter(handle)
        try:
            writer.wait_until_ready(timeout=30)
            assert attached.wait(timeout=30)
            time.sleep(0.3)  # let it get through the spin phase into the blocking poll
            ps = psutil.Process(proc.pid)
            before = ps.cpu_times()
            time.sleep(1.0)
            after = ps.cpu_times()
            used = (after.user - before.user) + (after.system - before.system)
            assert used < 0.3, f"idle reader burned {used:.3f}s CPU in ~1s"
            writer.enqueue("wake up", timeout=10)
            assert results.get(timeout=30) == "wake up"
            proc.join(timeout=30)
            assert proc.exitcode == 0
        finally:
            writer.shutdown()
            if proc.is_alive():
                proc.kill()


def _sleeping_reader(handle: MessageQueueHandle, n: int, results: Any) -> None:
    from executor import zmq_utils

    zmq_utils.POLL_TICK_MS = 600_000  # no poll tick ends a sleep: only a wake-up can
    mq = MessageQueueReader(handle, 1, spin_s=0.0)
    for _ in range(n):
        results.put(mq.dequeue(timeout=600))
    mq.shutdown()


@pytest.mark.timeout(120)
def test_sleeping_readers_are_woken_through_their_fifos() -> None:
    """Readers that never spin, in two processes, whose poll never times out by itself:
    every message reaches both, so every wake-up the writer sent through a reader's FIFO
    arrived. Each message is sent only once both readers announced they sleep."""
    n = 20
    with MessageQueueOwner(2) as creator:
        handle = creator.export_handle()
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=_sleeping_reader, args=(handle, n, results), daemon=True)
        proc.start()
        writer = MessageQueueWriter(handle)
        reader = MessageQueueReader(handle, 0, spin_s=0.0)
        got: list[Any] = []
        try:
            writer.wait_until_ready(timeout=60)
            ring = writer._ring
            assert ring is not None
            for i in range(n):
                thread = threading.Thread(target=lambda: got.append(reader.dequeue(timeout=60)))
                thread.start()
                while ring.asleep_readers() != [0, 1]:
                    time.sleep(0.001)
                writer.enqueue(("step", i), timeout=10)
                thread.join(timeout=60)
                assert results.get(timeout=60) == ("step", i)
            assert got == [("step", i) for i in range(n)]
            proc.join(timeout=60)
            assert proc.exitcode == 0
        finally:
            reader.shutdown()
            writer.shutdown()
            if proc.is_alive():
                proc.kill()


def _child_writer(handle: MessageQueueHandle, n: int) -> None:
    mq = MessageQueueWriter(handle)
    mq.wait_until_ready(timeout=30)
    for i in range(n):
        mq.enqueue((i, os.getpid(), b"z" * (5000 if i % 10 == 0 else i)), timeout=30)
    mq.shutdown()  # flushes pending overflow payloads before the process exits


@pytest.mark.timeout(60)
def test_writer_in_a_child_process() -> None:
    n = 200
    creator = MessageQueueOwner(1, max_chunk_bytes=4096, max_chunks=4)
    handle = creator.export_handle()
    reader = MessageQueueReader(handle, 0)
    proc = SPAWN.Process(target=_child_writer, args=(handle, n), daemon=True)
    proc.start()
    try:
        first = reader.dequeue(timeout=30)
        creator.unlink()  # the writer has attached: it produced a message
        assert first[0] == 0 and first[1] == proc.pid
        rest = [reader.dequeue(timeout=30) for _ in range(n - 1)]
        assert [m[0] for m in rest] == list(range(1, n))
        assert all(len(m[2]) == (5000 if m[0] % 10 == 0 else m[0]) for m in rest)
        with pytest.raises(QueueClosedError):
            reader.dequeue(timeout=30)
        proc.join(timeout=30)
        assert proc.exitcode == 0
    finally:
        reader.shutdown()
        creator.shutdown()
        if proc.is_alive():
            proc.kill()
    assert not _shm_exists(handle)


_TRACKER_SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp, os, signal, sys
    from executor.message_queue import MessageQueueOwner
    from executor.message_queue_reader import MessageQueueReader
    from executor.message_queue_writer import MessageQueueWriter

    def child(handle):
        mq = MessageQueueReader(handle, 0)
        assert mq.dequeue(timeout=30) == "hi"
        mq.shutdown()

    if __name__ == "__main__":
        creator = MessageQueueOwner(1)
        handle = creator.export_handle()
        proc = mp.get_context("spawn").Process(target=child, args=(handle,))
        proc.start()
        writer = MessageQueueWriter(handle)
        writer.enqueue("hi", timeout=30)
        proc.join(30)
        assert proc.exitcode == 0
        print(handle.shm_name, os.path.dirname(handle.data_addr[len("ipc://"):]), flush=True)
        if sys.argv[1] == "kill":  # creator dies before unlink: tracker must clean up
            os.kill(os.getpid(), signal.SIGKILL)
        writer.shutdown()
        creator.shutdown()
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["clean", "kill"])
def test_resource_tracker_no_warnings_and_cleans_after_sigkill(mode: str, tmp_path: Any) -> None:
    script = tmp_path / "tracker_script.py"
    script.write_text(_TRACKER_SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(script), mode], capture_output=True, text=True, timeout=50, env=env
    )
    name, ipc_dir = (proc.stdout.split() + ["", ""])[:2]
    shutil.rmtree(ipc_dir, ignore_errors=True)  # a SIGKILLed creator cannot remove it
    assert name.startswith("tpmq_"), (proc.stdout, proc.stderr)
    if mode == "clean":
        assert proc.returncode == 0
        assert proc.stderr == "", proc.stderr  # no tracker KeyError / "leaked" warnings
    else:
        assert proc.returncode == -9
    deadline = time.monotonic() + 10
    while os.path.exists(os.path.join("/dev/shm", name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(os.path.join("/dev/shm", name))
