"""RayDistributedExecutor: one Ray actor per TP rank, placed by a placement group.

Start-up, all from the engine's thread: connect to a cluster (`ray_utils.acquire_cluster`:
this process's connection, else RAY_ADDRESS or the cluster of a `ray start --head` on this
host, else a local instance started here); reserve one bundle per rank ({"CPU": 1} on the
CPU, {"GPU": 1} on CUDA) with `ray_placement_strategy`; create one `RayWorkerWrapper`
actor per bundle and ask each where it runs. Ranks are then numbered with the engine's
node first and the ranks of one node next to each other, so node-local ranks (CPU
pinning, GPU index) follow from the order. Rank 0's node IP and a port free there make
the tcp:// rendezvous. Every rank's `init_worker` runs at once; the first failure or death
fails the start-up with that rank's traceback or cause, and nothing is left running.

Liveness: each actor runs one call that never returns in its monitor concurrency group;
a monitor thread waits on those, so an actor that dies (killed, crashed, or its node
lost) marks the executor failed at once, and any pending or later call raises
EngineDeadError naming the rank, its node id and IP. The actors are owned by this
process: Ray kills them if it dies.

collective_rpc has MultiprocExecutor's semantics: the request is pickled once (and put in
the object store once when large), every actor runs it, and replies are awaited in rank
order while the other ranks are checked for an early failure.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import uuid
from typing import Any

from executor.abstract import Executor
from executor.errors import EngineDeadError, RemoteWorkerError, WorkerStartupError
from executor.ray_utils import acquire_cluster, import_ray, node_local_ranks, release_cluster, tcp_url
from executor.ray_worker import MONITOR_GROUP, RayNodeInfo, RayWorkerWrapper
from executor.rpc import ReadyMessage, RPCMethod, RPCReply, plan_call

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("TP_WORKER_STARTUP_TIMEOUT", "600"))
# A placement group the cluster cannot satisfy stays pending forever; fail instead.
PLACEMENT_TIMEOUT_S = float(os.environ.get("TP_RAY_PLACEMENT_TIMEOUT", "60"))
# How long shutdown waits for Ray to confirm that the killed actors are dead.
SHUTDOWN_GRACE_S = 5.0
# While one rank's reply is awaited, the other ranks' replies are checked this often.
_ERROR_POLL_S = 0.1
# Ray copies smaller arguments into each task; a larger request is put once for all ranks.
_INLINE_REQUEST_BYTES = 100 * 1024


def _cause(error: BaseException) -> str:
    """The line of a Ray actor error that says why the actor is gone (without Ray's
    paragraph of common causes)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("The actor is dead because"):
            return line.split(" Some common causes include", 1)[0]
    first = lines[0] if lines else type(error).__name__
    if type(error).__name__ == "ActorUnavailableError":
        return f"unreachable, its process or its whole node is gone ({first})"
    return first


class RayDistributedExecutor(Executor):
    """Every method is called from the engine's thread (the monitor thread only marks the
    executor failed). `nodes[rank]` says where each rank's actor runs."""

    def _init_executor(self) -> None:
        self._ray = import_ray()
        self._failure: str | None = None
        self._shutdown_started = False
        self._cluster_acquired = False
        self._rpc_lock = threading.Lock()
        self._call_id = 0
        self.actors: list[Any] = []
        self.nodes: list[RayNodeInfo] = []  # per rank: where its actor runs
        self._sentinels: list[Any] = []
        self._placement_group: Any = None
        self._monitor: threading.Thread | None = None
        try:
            on_cpu = self.config.device_config.device_type == "cpu"
            acquire_cluster(min_cpus=self.world_size if on_cpu else 0)
            self._cluster_acquired = True
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ start-up

    def _bundle(self) -> dict[str, float]:
        return {"GPU": 1.0} if self.config.device_config.device_type == "cuda" else {"CPU": 1.0}

    def _start_workers(self) -> None:
        ws = self.world_size
        start = time.perf_counter()
        strategy = self.config.parallel_config.ray_placement_strategy
        self._place_actors(strategy)
        self._sentinels = [a.wait_until_killed.options(concurrency_group=MONITOR_GROUP).remote() for a in self.actors]
        local = node_local_ranks([node.node_id for node in self.nodes])
        port = self._startup_get(self.actors[0].free_port.remote(), "rank 0")
        init_method = tcp_url(self.nodes[0].node_ip, port)
        self.startup_timings["spawn"] = time.perf_counter() - start
        logger.info("Ray: %d rank(s) placed (%s): %s; rendezvous %s", ws, strategy,
                    ", ".join(f"rank {r} on {n.node_ip} (node {n.node_id[:12]}, pid {n.pid})"
                              for r, n in enumerate(self.nodes)), init_method)
        ready = [
            actor.init_worker.remote(self.config, rank, local[rank][0], local[rank][1], init_method,
                                     self._visible_gpus(rank))
            for rank, actor in enumerate(self.actors)
        ]
        self._wait_for_ready(ready)
        self.startup_timings["startup_total"] = time.perf_counter() - start
        self._monitor = threading.Thread(target=self._monitor_actors, name="ray-actor-monitor", daemon=True)
        self._monitor.start()

    def _place_actors(self, strategy: str) -> None:
        """Reserve the placement group, start one actor per bundle, and number the ranks:
        the engine's node first, then by node, so the ranks of a node are contiguous."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, ws = self._ray, self.world_size
        bundle = self._bundle()
        self._placement_group = placement_group([dict(bundle) for _ in range(ws)], strategy=strategy,
                                                name=f"tp-engine-{uuid.uuid4().hex[:12]}")
        self._wait_for_placement(bundle, strategy)
        actor_cls = ray.remote(concurrency_groups={MONITOR_GROUP: 1})(RayWorkerWrapper)
        actors = [
            actor_cls.options(
                num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement_group,
                                                                     placement_group_bundle_index=index),
            ).remote()
            for index in range(ws)
        ]
        self.actors = actors  # recorded at once, so a failure below still kills them
        info_refs = [actor.node_info.remote() for actor in actors]
        infos = [self._startup_get(ref, f"the actor of bundle {i}") for i, ref in enumerate(info_refs)]
        engine_node = ray.get_runtime_context().get_node_id()
        order = sorted(range(ws), key=lambda i: (infos[i].node_id != engine_node, infos[i].node_ip,
                                                 infos[i].node_id, i))
        self.actors, self.nodes = [actors[i] for i in order], [infos[i] for i in order]

    def _wait_for_placement(self, bundle: dict[str, float], strategy: str) -> None:
        ray = self._ray
        try:
            ray.get(self._placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise WorkerStartupError(
                f"Ray could not place {self.world_size} bundle(s) of {bundle} ({strategy}) within "
                f"{PLACEMENT_TIMEOUT_S:.0f}s (TP_RAY_PLACEMENT_TIMEOUT); the cluster has {ray.cluster_resources()} "
                f"in all, {ray.available_resources()} free, on {len([n for n in ray.nodes() if n['Alive']])} node(s)"
            ) from None

    def _startup_get(self, ref: Any, who: str) -> Any:
        ray = self._ray
        try:
            return ray.get(ref, timeout=STARTUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise WorkerStartupError(f"{who} did not answer within {STARTUP_TIMEOUT_S:.0f}s "
                                     "(TP_WORKER_STARTUP_TIMEOUT)") from None
        except ray.exceptions.RayError as e:
            raise WorkerStartupError(f"{who} failed during start-up: {e}") from None

    def _visible_gpus(self, rank: int) -> str | None:
        """CUDA_VISIBLE_DEVICES for `rank`: the GPUs Ray gave the ranks of its node, in
        local-rank order (None on the CPU)."""
        if self.config.device_config.device_type != "cuda":
            return None
        node = self.nodes[rank].node_id
        return ",".join(n.gpu_ids[0] for n in self.nodes if n.node_id == node)

    def _wait_for_ready(self, ready: list[Any]) -> None:
        ray = self._ray
        pending = {ref: rank for rank, ref in enumerate(ready)}
        sentinels = {ref: rank for rank, ref in enumerate(self._sentinels)}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerStartupError(f"ranks {sorted(pending.values())} not ready after {STARTUP_TIMEOUT_S:.0f}s "
                                         "(TP_WORKER_STARTUP_TIMEOUT)")
            done, _ = ray.wait([*pending, *sentinels], num_returns=1, timeout=min(remaining, 1.0))
            for ref in done:
                if ref in sentinels:
                    rank = sentinels.pop(ref)
                    raise WorkerStartupError(self._death_message(rank, self._error_of(ref), "during start-up"))
                rank = pending.pop(ref)
                try:
                    msg: ReadyMessage = ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise WorkerStartupError(self._death_message(rank, e, "during start-up")) from None
                if not msg.ok:
                    raise WorkerStartupError(
                        f"rank {rank} ({self._where(rank)}) failed during start-up: {msg.error}\n"
                        f"--- remote traceback (rank {rank}) ---\n{msg.traceback}"
                    )

    # ------------------------------------------------------------------ liveness

    def _where(self, rank: int) -> str:
        node = self.nodes[rank]
        return f"Ray actor pid {node.pid} on node {node.node_id} at {node.node_ip}"

    def _death_message(self, rank: int, error: BaseException, when: str) -> str:
        return f"worker rank {rank} ({self._where(rank)}) died {when}: {_cause(error)}"

    def _error_of(self, ref: Any) -> BaseException:
        """The error a resolved sentinel carries (it only resolves when its actor is gone)."""
        try:
            self._ray.get(ref)
        except Exception as e:  # noqa: BLE001 - whatever Ray says is the cause
            return e
        return RuntimeError("its monitor call returned")

    def _mark_dead(self, rank: int, error: BaseException) -> str:
        if self._failure is None:
            self._failure = self._death_message(rank, error, "unexpectedly")
            logger.error("%s; the executor is dead", self._failure)
        return self._failure

    def _monitor_actors(self) -> None:
        ray = self._ray
        pending = {ref: rank for rank, ref in enumerate(self._sentinels)}
        try:
            while not self._shutdown_started:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                if done and not self._shutdown_started:
                    self._mark_dead(pending[done[0]], self._error_of(done[0]))
                    return
        except Exception:  # noqa: BLE001 - Ray itself went away (interpreter exit); calls will say so
            logger.debug("Ray actor monitor stopped", exc_info=True)

    def check_health(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(self._failure)
        if self._shutdown_started:
            raise EngineDeadError("the executor has been shut down")

    # ------------------------------------------------------------------ RPC

    def collective_rpc(
        self,
        method: RPCMethod,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        plan = plan_call(method, unique_reply_rank, self.world_size)
        # Pickled here, so unpicklable arguments raise in the caller, as on the mp backend.
        request = pickle.dumps((plan.payload, tuple(args), dict(kwargs or {})), protocol=pickle.HIGHEST_PROTOCOL)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._rpc_lock:
            self.check_health()
            self._call_id += 1
            arg = self._ray.put(request) if len(request) > _INLINE_REQUEST_BYTES else request
            refs = [actor.execute_method.remote(self._call_id, arg, unique_reply_rank) for actor in self.actors]
            results = self._collect_replies(refs, plan.ranks, plan.name, deadline, timeout)
        return plan.results(results, unique_reply_rank)

    def _collect_replies(
        self, refs: list[Any], ranks: list[int], name: str, deadline: float | None, timeout: float | None
    ) -> dict[int, Any]:
        """Wait for `ranks`' replies. While the awaited rank is silent, the other ranks'
        replies are checked too: a rank that failed or died (leaving its peers blocked in
        a collective) is reported at once, by name, instead of after the timeout."""
        ray = self._ray
        results: dict[int, Any] = {}
        waiting = list(ranks)
        while waiting:
            rank = waiting[0]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            slice_s = _ERROR_POLL_S if remaining is None else min(_ERROR_POLL_S, remaining)
            done, _ = ray.wait([refs[rank]], timeout=slice_s)
            if done:
                results[rank] = self._result_of(rank, refs[rank], name)
                waiting.remove(rank)
                continue
            others = [r for r in range(self.world_size) if r != rank and r not in results]
            if others:
                done, _ = ray.wait([refs[r] for r in others], num_returns=len(others), timeout=0)
                for other in others:
                    if refs[other] in done:
                        results[other] = self._result_of(other, refs[other], name)
                        if other in waiting:
                            waiting.remove(other)
            self.check_health()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"collective_rpc({name!r}) timed out after {timeout}s waiting for rank {rank}")
        return results

    def _result_of(self, rank: int, ref: Any, name: str) -> Any:
        ray = self._ray
        try:
            reply: RPCReply = ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # execute_method itself raised (not the method it ran)
            raise RemoteWorkerError(rank, name, str(e).splitlines()[0], str(e)) from None
        except ray.exceptions.RayError as e:  # the actor, its node, or the reply is gone
            raise EngineDeadError(self._mark_dead(rank, e)) from None
        if not reply.ok:
            # A peer's death explains a rank's failure (a broken collective) better.
            self.check_health()
            raise RemoteWorkerError(reply.rank, name, reply.error or "", reply.traceback or "")
        return None if reply.result is None else pickle.loads(reply.result)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Kill every actor, remove the placement group, and release the cluster
        connection (which stops a local instance started for this process once no engine
        uses it). Idempotent; also safe after Ray itself was shut down.

        The actors are killed without a word first: a rank may be stuck in a collective,
        and a killed rank leaves nothing behind (its shared-memory segments were
        unlinked when mapped, its rendezvous store dies with it)."""
        if self._shutdown_started:
            return
        self._shutdown_started = True
        ray = getattr(self, "_ray", None)
        if ray is not None and ray.is_initialized():
            for actor in self.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead
                    pass
            if self._sentinels:
                # They resolve once Ray has each actor dead, so its bundle is free on return.
                ray.wait(self._sentinels, num_returns=len(self._sentinels), timeout=SHUTDOWN_GRACE_S)
            if self._placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._placement_group)
        if self._monitor is not None:
            self._monitor.join(timeout=SHUTDOWN_GRACE_S)
        if self._cluster_acquired:
            self._cluster_acquired = False
            release_cluster()
