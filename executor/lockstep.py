"""Lockstep between the ranks of the external launcher: rank 0 decides, the others follow.

Under torchrun every rank runs its own EngineCore, so nothing but this channel keeps
their steps identical. It is one gloo group of its own (a CPU group even when the TP
group is NCCL), created by every rank at start-up, and used two ways:

- Every rank calls `generate()` itself (programmatic use): each rank schedules, runs
  and samples on its own, then `sync_sampled_tokens` broadcasts rank 0's sampled
  tokens (one fixed-size int64 broadcast per step) so the schedulers can never drift;
  the same broadcast carries a fingerprint of rank 0's schedule, and a rank whose
  schedule differs raises `LockstepDivergedError` instead of joining the wrong
  collectives.
- Only rank 0 has an engine loop (`engine.serve`): rank 0 sends each call it makes on
  its worker (`execute_model` with its SchedulerOutput, or any other collective_rpc)
  with `send_call`, and `LockstepFollower.run` on every other rank runs the same call
  on its own worker, until `send_shutdown`.

The group's timeout is effectively unbounded: a follower waits for rank 0 as long as
the server sits idle. A dead peer still ends a wait at once (gloo sees the connection
close); a hung but live rank 0 is waited for, as in any collective.
"""

from __future__ import annotations

import hashlib
import pickle
import queue
import threading
from array import array
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import cloudpickle
import numpy as np
import torch
import torch.distributed as dist

from executor.rpc import RPCMethod, run_method

if TYPE_CHECKING:
    from worker.outputs import ModelRunnerOutput, SchedulerOutput
    from worker.worker import Worker

_IDLE_FOREVER = timedelta(days=3650)
# One broadcast carries a message up to this size (a decode step of a few dozen
# requests); a longer one sends its remainder in a second broadcast.
FRAME_BYTES = 16 * 1024
_HEADER = 16  # int64 kind, int64 total payload length
_CALL, _SHUTDOWN = 1, 2


class LockstepDivergedError(RuntimeError):
    """This rank's schedule for a step is not rank 0's: the ranks were not given the
    same requests in the same order (programmatic use under torchrun)."""


class LeaderLostError(RuntimeError):
    """A follower lost rank 0 (it died, or its process group went away)."""


def schedule_fingerprint(scheduler_output: SchedulerOutput) -> int:
    """A 63-bit digest of what a step runs: its number of decode steps, each request's
    id, position, tokens and whether it samples, in order (the tokens as one buffer: a
    prefill hashes in µs)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(array("q", [scheduler_output.num_steps]).tobytes())
    for req in scheduler_output.scheduled:
        digest.update(req.req_id.encode("utf-8") + b"\0")
        digest.update(array("q", [req.start_pos, len(req.token_ids), int(req.sample), *req.token_ids]).tobytes())
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


class LockstepChannel:
    """The control group. Created on every rank at the same point of start-up (after
    the TP group, before the model loads); every method below names the ranks that may
    call it, and a call on one rank must be matched on every rank in the same order."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = dist.new_group(backend="gloo", timeout=_IDLE_FOREVER)
        # Rank 0 sends from it, a follower's receiver thread receives into it: one user each.
        self._frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)

    # ------------------------------------------------------------- start-up collectives

    def min_over_ranks(self, value: int) -> int:
        """Every rank: the smallest `value` of all ranks (the KV budget they agree on)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank: each rank's picklable `obj`, in rank order."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # ------------------------------------------------------------- programmatic use

    def sync_sampled_tokens(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput,
                            max_num_seqs: int, max_steps: int = 1) -> ModelRunnerOutput:
        """Every rank, after each step it ran: `output` with rank 0's sampled tokens (every
        step's, for a multi-step output of at most `max_steps`).

        Logprobs stay this rank's own; they equal rank 0's wherever the tokens did.
        Raises LockstepDivergedError if this rank ran another schedule than rank 0."""
        n = len(output.sampled_token_ids)
        steps = [output.sampled_token_ids, *output.later_token_ids]
        if n > max_num_seqs or len(steps) > max_steps:
            raise ValueError(f"{n} sampled tokens in each of {len(steps)} steps exceed max_num_seqs={max_num_seqs} "
                             f"or num_scheduler_steps={max_steps}")
        buf = torch.zeros(2 + max_num_seqs * max_steps, dtype=torch.int64)  # same size on every rank
        fingerprint = schedule_fingerprint(scheduler_output)
        if self.rank == 0:
            buf[0], buf[1] = fingerprint, n
            buf[2 : 2 + n * len(steps)] = torch.tensor([t for tokens in steps for t in tokens], dtype=torch.int64)
        dist.broadcast(buf, src=0, group=self.group)
        if self.rank != 0:
            if int(buf[0]) != fingerprint or int(buf[1]) != n:
                raise LockstepDivergedError(
                    f"rank {self.rank} scheduled {[r.req_id for r in scheduler_output.scheduled]} ({n} to sample), "
                    f"which is not rank 0's schedule ({int(buf[1])} to sample): under the external launcher every "
                    "rank must add the same requests, with the same ids, in the same order"
                )
            tokens = buf[2 : 2 + n * len(steps)].tolist()
            output.sampled_token_ids = tokens[:n]
            output.later_token_ids = [tokens[i * n : (i + 1) * n] for i in range(1, len(steps))]
        return output

    # ------------------------------------------------------------- rank 0 leads

    def send_call(self, method: RPCMethod, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Rank 0: have every follower run `method` on its worker (as collective_rpc)."""
        payload = method if isinstance(method, str) else cloudpickle.dumps(method)
        self._send(_CALL, pickle.dumps((payload, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL))

    def send_shutdown(self) -> None:
        """Rank 0: end every follower's `LockstepFollower.run`."""
        self._send(_SHUTDOWN, b"")

    def _send(self, kind: int, payload: bytes) -> None:
        assert self.rank == 0, "only rank 0 sends"
        frame = self._frame.numpy()
        frame[:_HEADER].view(np.int64)[:] = (kind, len(payload))
        first = min(len(payload), FRAME_BYTES - _HEADER)
        frame[_HEADER : _HEADER + first] = np.frombuffer(payload, dtype=np.uint8, count=first)
        dist.broadcast(self._frame, src=0, group=self.group)
        if len(payload) > first:
            rest = np.frombuffer(payload, dtype=np.uint8, offset=first).copy()
            dist.broadcast(torch.from_numpy(rest), src=0, group=self.group)

    def recv(self) -> tuple[int, bytes]:
        """Ranks > 0 (one thread): rank 0's next message, as (kind, payload). Blocks
        with no bound; raises when rank 0 or the group goes away."""
        dist.broadcast(self._frame, src=0, group=self.group)
        frame = self._frame.numpy()
        kind, length = (int(v) for v in frame[:_HEADER].view(np.int64))
        first = min(length, FRAME_BYTES - _HEADER)
        payload = frame[_HEADER : _HEADER + first].tobytes()
        if length > first:
            rest = torch.empty(length - first, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            payload += rest.numpy().tobytes()
        return kind, payload


class LockstepFollower:
    """Ranks > 0 while rank 0 serves: run each of rank 0's calls on this rank's worker.

    Messages are received on a thread, so that the calling (main) thread stays free to
    handle signals and to give up (`should_leave`) while rank 0 is silent."""

    def __init__(self, channel: LockstepChannel, worker: Worker) -> None:
        if channel.rank == 0:
            raise ValueError("rank 0 leads; only ranks > 0 follow")
        self.channel = channel
        self.worker = worker
        self._inbox: queue.SimpleQueue[tuple[int, bytes] | BaseException] = queue.SimpleQueue()
        self._receiver = threading.Thread(target=self._receive, name="lockstep-receiver", daemon=True)

    def _receive(self) -> None:
        while True:
            try:
                kind, payload = self.channel.recv()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                self._inbox.put(e)
                return
            self._inbox.put((kind, payload))
            if kind == _SHUTDOWN:
                return

    def run(self, should_leave: Callable[[], bool] = lambda: False, poll_s: float = 0.1) -> bool:
        """Run rank 0's calls until it sends shutdown (returns True) or `should_leave()`
        turns True while waiting (returns False: the receiver thread may still be
        blocked in the control group, which destroying the process group ends).

        Raises LeaderLostError when rank 0 is gone, and whatever a call raises (this
        rank then no longer matches rank 0, so it must stop)."""
        self._receiver.start()
        while True:
            try:
                message = self._inbox.get(timeout=poll_s)
            except queue.Empty:
                if should_leave():
                    return False
                continue
            if isinstance(message, BaseException):
                raise LeaderLostError(f"rank {self.channel.rank} lost rank 0: {message}") from message
            kind, payload = message
            if kind == _SHUTDOWN:
                self._receiver.join()
                return True
            method, args, kwargs = pickle.loads(payload)
            run_method(self.worker, method, args, kwargs)
