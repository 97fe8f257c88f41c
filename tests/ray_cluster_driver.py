"""The engine process of the two-node test in test_ray_executor.py (run as a script).

    python tests/ray_cluster_driver.py MODEL_DIR HEAD_ADDRESS

A fresh process, so the engines themselves find the cluster: the first through the
address the head's `ray start --head` recorded (RAY_TMPDIR is the head's temp root,
RAY_ADDRESS is unset), the second through RAY_ADDRESS. It prints one `RESULT <json>` line
per step and reads nothing:

1. "spread": a TP=2 SPREAD engine; its greedy tokens, where each rank says it runs
   (node id, node-local rank and size, cores), where the executor placed it, and what
   the engine logged about the cluster; then shutdown, which must leave the engine's
   connection closed and the cluster up, with the engine's placement group removed and
   every CPU free again ("after_shutdown").
2. "ready_to_lose_node": a second SPREAD engine, then a call that stays in flight on
   rank 0 while the test kills rank 1's node; "dead": the EngineDeadError it raised,
   and the one a later call raises.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

PROMPTS = [[1, 17, 42, 99, 3], [250, 4, 8, 15, 16, 23, 42]]
MAX_TOKENS = 8


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def report(step: str, **fields: object) -> None:
    print("RESULT " + json.dumps({"step": step, **fields}), flush=True)


def where_am_i(worker: object) -> dict[str, object]:
    import ray

    return {"rank": worker.rank, "node_id": ray.get_runtime_context().get_node_id(),
            "local_rank": worker.local_rank, "local_world_size": worker.local_world_size,
            "cpus": sorted(os.sched_getaffinity(0)), "pid": os.getpid()}


def busy_on_rank_0(worker: object) -> int:
    time.sleep(60 if worker.rank == 0 else 0)
    return worker.rank


def placed(core: object) -> list[dict[str, object]]:
    return [{"node_id": n.node_id, "node_ip": n.node_ip, "pid": n.pid} for n in core.model_executor.nodes]


def main(model: str, head_address: str) -> None:
    import ray

    from config import SamplingParams
    from engine.core import EngineCore
    from executor.errors import EngineDeadError
    from tests.runtime_helpers import engine_config

    recorder = _Recorder()
    cluster_log = logging.getLogger("executor.ray_utils")
    cluster_log.setLevel(logging.INFO)
    cluster_log.addHandler(recorder)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    config = engine_config(model, tp=2, distributed_executor_backend="ray", ray_placement_strategy="SPREAD")
    with EngineCore(config) as core:
        tokens = [o.token_ids for o in core.generate(PROMPTS, params)]
        pg_id = core.model_executor._placement_group.id.hex()
        report("spread", tokens=tokens, ranks=core.collective_rpc(where_am_i), placed=placed(core),
               log=recorder.messages)
    still_connected = ray.is_initialized()
    ray.init(address=head_address, _node_ip_address=os.environ["TP_RAY_NODE_IP"])
    deadline = time.monotonic() + 10  # the GCS frees a removed group's bundles asynchronously
    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources().get("CPU", 0.0):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    report("after_shutdown", still_connected=still_connected,
           pg_state=ray.util.placement_group_table().get(pg_id, {}).get("state"),
           alive_nodes=len([n for n in ray.nodes() if n["Alive"]]),
           free_cpus=ray.available_resources().get("CPU", 0.0), total_cpus=ray.cluster_resources().get("CPU", 0.0))
    ray.shutdown()

    os.environ["RAY_ADDRESS"] = head_address
    recorder.messages.clear()
    core = EngineCore(config)
    try:
        report("ready_to_lose_node", placed=placed(core), log=recorder.messages)
        try:
            core.collective_rpc(busy_on_rank_0, timeout=120)
            report("dead", error=None)
        except EngineDeadError as e:
            report("dead", error=str(e), later=_later_call_error(core))
    finally:
        core.shutdown()


def _later_call_error(core: object) -> str | None:
    from executor.errors import EngineDeadError

    try:
        core.collective_rpc("check_health", timeout=30)
    except EngineDeadError as e:
        return str(e)
    return None


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
