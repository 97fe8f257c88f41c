"""RayWorkerWrapper: the body of one Ray actor, i.e. one TP rank and its Worker.

RayDistributedExecutor turns this plain class into an actor (`ray.remote(...)`, one per
placement-group bundle) and calls, in order: `node_info()` (where did Ray put me),
`free_port()` on the future rank 0, `init_worker(...)` (build the Worker, join the TP
group, load the shard; reported as a ReadyMessage), then `execute_method(...)` once per
collective_rpc, each answered with an RPCReply, until the executor kills the actor
(`ray.kill`: nothing in it needs an orderly exit). The same Worker and
the same `run_method` as the multiprocess backend run the calls, so a method or a
callable behaves identically on both.

`wait_until_killed()` runs in the actor's "monitor" concurrency group, beside the worker
calls: it never returns, so its result arrives only as the actor's death, which is how
the executor learns of it at once (the Ray counterpart of a process sentinel).

Everything here runs inside the actor's process, on the thread Ray gives the call.
"""

from __future__ import annotations

import os
import pickle
import threading
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from executor.ray_utils import free_port, interface_for_ip
from executor.rpc import ReadyMessage, RPCReply, run_method
from worker.worker import Worker

if TYPE_CHECKING:
    from config import EngineConfig

MONITOR_GROUP = "monitor"


@dataclass(frozen=True)
class RayNodeInfo:
    """Where Ray placed one actor."""

    node_id: str
    node_ip: str
    pid: int
    gpu_ids: tuple[str, ...]  # the accelerator ids Ray assigned it (empty on CPU)


class RayWorkerWrapper:
    def __init__(self) -> None:
        self.rank: int | None = None
        self.worker: Worker | None = None

    def node_info(self) -> RayNodeInfo:
        import ray

        context = ray.get_runtime_context()
        gpu_ids = context.get_accelerator_ids().get("GPU", [])
        return RayNodeInfo(context.get_node_id(), ray.util.get_node_ip_address(), os.getpid(),
                           tuple(str(g) for g in gpu_ids))

    def free_port(self) -> int:
        """A port for the TP rendezvous store, free on this actor's node IP (rank 0 only)."""
        import ray

        return free_port(ray.util.get_node_ip_address())

    def init_worker(self, config: EngineConfig, rank: int, local_rank: int, local_world_size: int,
                    init_method: str, visible_gpus: str | None) -> ReadyMessage:
        """Build this rank's Worker, join the TP group and load the shard. Never raises:
        a failure comes back as a not-ok ReadyMessage with the traceback.

        `visible_gpus`: CUDA_VISIBLE_DEVICES for every rank of this node (the GPUs Ray
        gave them, in local-rank order), so that local_rank indexes this rank's GPU and
        the node's ranks can see one another's; None on CPU."""
        self.rank = rank
        # tqdm's default lock is a multiprocessing semaphore, which a killed actor would
        # leave in /dev/shm; one process needs only a thread lock.
        tqdm.set_lock(threading.RLock())
        try:
            if visible_gpus is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus  # before torch initialises CUDA
            if "GLOO_SOCKET_IFNAME" not in os.environ:
                # gloo otherwise takes the address the hostname resolves to, which may
                # not be the network Ray (and the other nodes) use.
                import ray

                interface = interface_for_ip(ray.util.get_node_ip_address())
                if interface is not None:
                    os.environ["GLOO_SOCKET_IFNAME"] = interface
            self.worker = Worker(config, local_rank=local_rank, rank=rank, distributed_init_method=init_method,
                                 local_world_size=local_world_size)
            self.worker.init_device()
            self.worker.load_model()
        except BaseException as e:  # noqa: BLE001 - reported to the executor, which fails the start-up
            return ReadyMessage(rank, False, os.getpid(), error=f"{type(e).__name__}: {e}",
                                traceback=traceback.format_exc())
        return ReadyMessage(rank, True, os.getpid(), timings=self.worker.get_timings())

    def execute_method(self, call_id: int, request: bytes, reply_rank: int | None) -> RPCReply:
        """Run one collective_rpc call: `request` is the pickled (method, args, kwargs)
        (method a name, or a cloudpickled callable). A rank that is not `reply_rank`
        answers only ok/failed; the result travels pickled, so one that cannot be sent
        back is this call's error, not the actor's death."""
        assert self.worker is not None and self.rank is not None, "init_worker() must run first"
        try:
            method, args, kwargs = pickle.loads(request)
            result: Any = run_method(self.worker, method, args, kwargs)
        except Exception as e:
            return RPCReply(call_id, self.rank, False, error=f"{type(e).__name__}: {e}",
                            traceback=traceback.format_exc())
        if reply_rank is not None and reply_rank != self.rank:
            return RPCReply(call_id, self.rank, True)
        try:
            return RPCReply(call_id, self.rank, True, result=pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # noqa: BLE001 - e.g. a lock; nothing was sent
            return RPCReply(call_id, self.rank, False, error=f"cannot send the result back: {type(e).__name__}: {e}",
                            traceback=traceback.format_exc())

    def wait_until_killed(self) -> None:
        """Blocks for the actor's whole life (monitor group); see the module docstring."""
        threading.Event().wait()  # never set: only the actor's death ends this call
