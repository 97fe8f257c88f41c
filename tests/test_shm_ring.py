"""Tests for executor.shm_ring: the ring's flag protocol on real shared memory, no ZeroMQ."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from executor.shm_ring import RingLayout, RingSpec, ShmRing, ShmSegment

SPAWN = mp.get_context("spawn")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spec(n_reader: int = 2, max_chunk_bytes: int = 256, max_chunks: int = 4) -> RingSpec:
    return RingSpec(f"tpring_test_{os.getpid()}_{uuid.uuid4().hex[:8]}", n_reader, max_chunk_bytes, max_chunks)


def _shm_exists(spec: RingSpec) -> bool:
    return os.path.exists(os.path.join("/dev/shm", spec.shm_name))


@pytest.fixture
def segment() -> Iterator[ShmSegment]:
    seg = ShmSegment(_spec())
    try:
        yield seg
    finally:
        seg.close()


def _read(ring: ShmRing, idx: int, rank: int) -> bytes:
    assert ring.readable(idx, rank)
    length, overflow = ring.chunk_meta(idx)
    assert not overflow
    with ring.payload(idx, length) as view:
        data = bytes(view)
    ring.mark_read(idx, rank)
    return data


def test_write_then_every_reader_reads_once(segment: ShmSegment) -> None:
    ring = ShmRing.attach(segment.spec)
    try:
        assert ring.chunk_free(0) and not ring.readable(0, 0) and not ring.readable(0, 1)
        ring.write_chunk(0, b"hello", overflow=False)
        for rank in (0, 1):
            assert _read(ring, 0, rank) == b"hello"
            assert not ring.readable(0, rank)  # consumed: not seen twice
        ring.write_chunk(1, b"x" * 1000, overflow=True)  # bigger than a chunk: length only
        assert ring.readable(1, 0) and ring.chunk_meta(1) == (1000, True)
    finally:
        ring.close()


def test_a_reader_not_done_blocks_reuse_of_its_chunk() -> None:
    seg = ShmSegment(_spec(n_reader=2, max_chunks=1))
    writer, reader = ShmRing.attach(seg.spec), ShmRing.attach(seg.spec)
    try:
        writer.write_chunk(0, b"first", overflow=False)
        assert not writer.chunk_free(0)
        assert _read(reader, 0, 0) == b"first"
        assert not writer.chunk_free(0)  # rank 1 has not read it yet
        assert not writer.all_chunks_free()
        assert _read(reader, 0, 1) == b"first"
        assert writer.chunk_free(0) and writer.all_chunks_free()
        writer.write_chunk(0, b"second", overflow=False)
        assert [_read(reader, 0, r) for r in (0, 1)] == [b"second", b"second"]
    finally:
        writer.close()
        reader.close()
        seg.close()


def test_wrap_around_keeps_order_and_sizes() -> None:
    seg = ShmSegment(_spec(n_reader=1, max_chunk_bytes=64, max_chunks=3))
    ring = ShmRing.attach(seg.spec)
    try:
        w_idx = r_idx = 0
        got = []
        for i in range(10):
            msg = bytes([i]) * (i * 7 % 65)  # 0..64 bytes, including an empty and a full chunk
            assert ring.chunk_free(w_idx)
            ring.write_chunk(w_idx, msg, overflow=False)
            w_idx = (w_idx + 1) % 3
            if i % 2:  # the reader lags by up to two messages, so chunks are reused behind it
                while ring.readable(r_idx, 0):
                    got.append(_read(ring, r_idx, 0))
                    r_idx = (r_idx + 1) % 3
        while ring.readable(r_idx, 0):
            got.append(_read(ring, r_idx, 0))
            r_idx = (r_idx + 1) % 3
        assert got == [bytes([i]) * (i * 7 % 65) for i in range(10)]
        assert w_idx == r_idx == 10 % 3
    finally:
        ring.close()
        seg.close()


def test_ring_full_until_the_slowest_reader_reads() -> None:
    seg = ShmSegment(_spec(n_reader=2, max_chunks=2))
    ring = ShmRing.attach(seg.spec)
    try:
        ring.write_chunk(0, b"a", overflow=False)
        ring.write_chunk(1, b"b", overflow=False)
        assert not ring.chunk_free(0)  # the next write would overwrite unread data
        assert _read(ring, 0, 0) == b"a" and _read(ring, 1, 0) == b"b"
        assert not ring.chunk_free(0)
        assert _read(ring, 0, 1) == b"a"
        assert ring.chunk_free(0) and not ring.chunk_free(1)
    finally:
        ring.close()
        seg.close()


def test_closed_gone_and_asleep_flags(segment: ShmSegment) -> None:
    ring = ShmRing.attach(segment.spec)
    try:
        assert not ring.writer_closed() and ring.gone_readers() == [] and ring.asleep_readers() == []
        ring.set_asleep(1, True)
        assert ring.asleep_readers() == [1]
        ring.set_asleep(1, False)
        assert ring.asleep_readers() == []
        ring.write_chunk(0, b"last", overflow=False)
        ring.mark_writer_closed()
        assert ring.writer_closed()
        assert _read(ring, 0, 0) == b"last"  # closing does not drop what was written
        ring.mark_reader_gone(1)
        assert ring.gone_readers() == [1]
    finally:
        ring.close()


def test_unlink_and_close_leave_no_dev_shm_entry() -> None:
    seg = ShmSegment(_spec())
    spec = seg.spec
    assert _shm_exists(spec)
    ring = ShmRing.attach(spec)
    seg.unlink()
    seg.unlink()  # idempotent
    assert not _shm_exists(spec)
    ring.write_chunk(0, b"still mapped", overflow=False)
    late = ShmRing.attach(spec)  # the owner's own process may still attach
    assert _read(late, 0, 0) == b"still mapped"
    late.close()
    ring.close()
    seg.close()
    seg.close()
    assert not _shm_exists(spec)
    with pytest.raises(FileNotFoundError):
        ShmRing.attach(spec)  # owner gone: the name is really gone


@pytest.mark.slow
def test_bad_geometry_and_short_segment() -> None:
    with pytest.raises(ValueError):
        ShmSegment(_spec(n_reader=0))
    seg = ShmSegment(_spec(max_chunks=1))
    try:
        bigger = RingSpec(seg.spec.shm_name, seg.spec.n_reader, seg.spec.max_chunk_bytes, 8)
        assert RingLayout.of(bigger).total > RingLayout.of(seg.spec).total
        # Through shm_open, as another process would (not the owner's fd).
        proc = subprocess.run(
            [sys.executable, "-c", "import sys; from executor.shm_ring import *; "
             f"spec = RingSpec({bigger.shm_name!r}, {bigger.n_reader}, {bigger.max_chunk_bytes}, 8)\n"
             "try:\n    ShmRing.attach(spec)\nexcept ValueError:\n    sys.exit(3)"],
            env=dict(os.environ, PYTHONPATH=REPO_ROOT), timeout=60,
        )
        assert proc.returncode == 3
    finally:
        seg.close()


def _child_reader(spec: RingSpec, n: int, results: Any) -> None:
    ring = ShmRing.attach(spec)
    try:
        idx, got = 0, []
        deadline = time.monotonic() + 60
        while len(got) < n and time.monotonic() < deadline:
            if ring.readable(idx, 1):
                got.append(_read(ring, idx, 1))
                idx = (idx + 1) % spec.max_chunks
            else:
                time.sleep(1e-4)  # slower than the writer: it must wait for us
        results.put((got, "zmq" in sys.modules))
    finally:
        ring.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_second_process_reads_every_message_through_a_small_ring() -> None:
    n = 200
    seg = ShmSegment(_spec(n_reader=2, max_chunk_bytes=128, max_chunks=2))
    ring = ShmRing.attach(seg.spec)
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=_child_reader, args=(seg.spec, n, results), daemon=True)
    proc.start()
    try:
        msgs = [i.to_bytes(2, "little") * (i % 64) for i in range(n)]
        ours = []
        w_idx = r_idx = 0
        deadline = time.monotonic() + 60
        for msg in msgs:
            while not ring.chunk_free(w_idx):
                # Rank 0 is read here; rank 1 (the child) holds chunks until it catches up.
                if ring.readable(r_idx, 0):
                    ours.append(_read(ring, r_idx, 0))
                    r_idx = (r_idx + 1) % 2
                assert time.monotonic() < deadline, "the child never freed a chunk"
            ring.write_chunk(w_idx, msg, overflow=False)
            w_idx = (w_idx + 1) % 2
        while len(ours) < n:
            ours.append(_read(ring, r_idx, 0))
            r_idx = (r_idx + 1) % 2
        got, child_imported_zmq = results.get(timeout=60)
        assert got == msgs and ours == msgs
        assert not child_imported_zmq
        proc.join(timeout=30)
        assert proc.exitcode == 0
    finally:
        ring.close()
        seg.close()
        if proc.is_alive():
            proc.kill()
    assert not _shm_exists(seg.spec)
