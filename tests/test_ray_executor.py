"""distributed_executor_backend="ray" on real Ray processes, CPU only, loopback only.

One local Ray instance (started here with `ray.init`, node IP 127.0.0.2) carries most
tests: a TP=2 engine whose greedy tokens equal the multiprocess backend's and
transformers'; test_engine_runtime.py's collective_rpc tests, imported below and run
against it unchanged (its timeout test in a variant without a wall-clock bound); a second
engine at the same time; killed actors. A two-node cluster
(`ray start --head` on 127.0.0.3, a second `ray start` on 127.0.0.4), which a fresh engine
process finds through the head's recorded address and then RAY_ADDRESS, runs TP=2 SPREAD
with one rank per node, and loses a node. `python -m engine.serve` with no cluster starts
its own instance (127.0.0.5) and stops it. Every Ray process started here must be gone
at the end, and no connection of theirs may leave 127.0.0.0/8.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import psutil
import pytest
import ray
import torch

from config import ConfigError, SamplingParams
from engine.core import EngineCore
from engine.entrypoints.cli_args import build_parser
from executor.errors import EngineDeadError, RemoteWorkerError, WorkerStartupError
from executor.ray_distributed_executor import RayDistributedExecutor
from executor.ray_utils import node_local_ranks
from tests.conftest import REPO, tiny_llama_with_tokenizer
from tests.ray_helpers import (
    RAY_TEST_ENV,
    LocalRay,
    RayNode,
    assert_gone,
    outside_loopback_peers,
    processes,
    ray_descendants,
    short_temp_dir,
)
from tests.runtime_helpers import DEATH_BOUND_S, engine_config, fail_on_rank_1_while_rank_0_waits

# The collective_rpc specification of the multiprocess backend, run here against the
# Ray engine (their `engine_tp2` fixture is the one defined below).
from tests.test_engine_runtime import (  # noqa: F401
    test_generate_refusing_a_prompt_leaves_no_request_behind,
    test_remote_exception_carries_traceback,
    test_rpc_by_name,
    test_rpc_timeout_with_unique_reply_rank,
    test_rpc_unique_reply_rank,
    test_unpicklable_args_raise_in_the_caller,
    test_unpicklable_result_is_a_remote_error,
)
from tests.test_serve import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LOCAL_IP, HEAD_IP, NODE2_IP, SERVE_IP = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"
PROMPTS = [[1, 17, 42, 99, 3], [250, 4, 8, 15, 16, 23, 42], list(range(10, 40))]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SHM_PATTERNS = ("tp-allreduce-", "tpmq_", "sem.mp-", "plasma")


def ray_config(model: Path, tp: int = 2, **overrides: Any):
    return engine_config(model, tp=tp, distributed_executor_backend="ray", **overrides)


def tokens_of(core: EngineCore, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in core.generate(prompts, GREEDY)]


def actor_pids(core: EngineCore) -> list[int]:
    return [node.pid for node in core.model_executor.nodes]


def _our_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PATTERNS)}


@pytest.fixture(scope="module")
def ray_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in RAY_TEST_ENV.items():
            mp.setenv(key, value)
        mp.delenv("RAY_ADDRESS", raising=False)
        yield


@pytest.fixture(scope="module")
def local_ray(ray_env: None) -> Iterator[LocalRay]:
    """The local instance of this module (4 logical CPUs: two TP=2 engines at once)."""
    shm_before = _our_shm()
    cluster = LocalRay(LOCAL_IP, num_cpus=4)
    yield cluster
    cluster.stop()
    # A segment that is still there a moment later is a leak, not another test's start-up.
    leaked = _our_shm() - shm_before
    time.sleep(0.5)
    assert not leaked & _our_shm(), f"left in /dev/shm: {sorted(leaked & _our_shm())}"


@pytest.fixture(scope="module")
def engine_tp2(local_ray: LocalRay, tiny_models: dict[str, Path]) -> Iterator[EngineCore]:
    """One TP=2 Ray engine shared by the RPC tests; each of them leaves it working."""
    core = EngineCore(ray_config(tiny_models["llama"]))
    local_ray.record()
    try:
        yield core
    finally:
        actors = processes(actor_pids(core))
        core.shutdown()
        assert_gone(actors, "actors of the shared engine")


@pytest.fixture(scope="module")
def hf_tokens(tiny_models: dict[str, Path]) -> Callable[[str], list[list[int]]]:
    """hf_tokens(name) -> transformers' greedy tokens for PROMPTS, cached per model."""
    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(str(tiny_models[name]), dtype=torch.float32).eval()
            cache[name] = []
            for prompt in PROMPTS:
                mask = torch.ones(1, len(prompt), dtype=torch.long)
                with torch.no_grad():
                    out = hf.generate(torch.tensor([prompt]), attention_mask=mask, do_sample=False,
                                      max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
                cache[name].append(out[0, len(prompt):].tolist())
        return cache[name]

    return get


# ---------------------------------------------------------------- one node


@pytest.mark.slow
def test_tp2_engine_on_ray_matches_mp_and_transformers(engine_tp2, tiny_models, hf_tokens):
    executor = engine_tp2.model_executor
    assert isinstance(executor, RayDistributedExecutor)
    pids = actor_pids(engine_tp2)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert [n.node_ip for n in executor.nodes] == [LOCAL_IP, LOCAL_IP]

    def layout(worker):
        return worker.rank, worker.local_rank, worker.local_world_size, os.getpid(), sorted(os.sched_getaffinity(0))

    ranks = engine_tp2.collective_rpc(layout)
    assert [r[:4] for r in ranks] == [(0, 0, 2, pids[0]), (1, 1, 2, pids[1])]
    # cpu_threads_bind="auto": the node's cores split between its two ranks.
    cores = [set(r[4]) for r in ranks]
    assert all(cores) and not cores[0] & cores[1]

    got = tokens_of(engine_tp2)
    assert got == hf_tokens("llama")
    with EngineCore(engine_config(tiny_models["llama"], tp=2, distributed_executor_backend="mp")) as mp_core:
        assert tokens_of(mp_core) == got


def test_rpc_callable_runs_in_each_ranks_actor(engine_tp2):
    secret = {"value": 1234}

    def closure(worker, offset, scale=1):
        return worker.rank, secret["value"] * scale + offset, os.getpid()

    results = engine_tp2.collective_rpc(closure, args=(5,), kwargs={"scale": 2})
    assert results == [(0, 2473, actor_pids(engine_tp2)[0]), (1, 2473, actor_pids(engine_tp2)[1])]


@pytest.mark.slow
def test_rpc_timeout_leaves_the_slow_call_running_and_the_engine_working(engine_tp2, tmp_path):
    """As test_engine_runtime's timeout test, with no wall-clock bound: the slow call is
    seen still running (its marker file is not there yet) when TimeoutError arrives."""

    def slow(worker, seconds, marker):
        time.sleep(seconds)
        Path(f"{marker}.{worker.rank}").touch()
        return ("late", worker.rank)

    marker = tmp_path / "slow-call-done"
    with pytest.raises(TimeoutError, match="timed out"):
        engine_tp2.collective_rpc(slow, args=(3.0, str(marker)), timeout=0.5)
    assert not list(tmp_path.glob("slow-call-done.*"))
    # The late replies of the timed-out call are discarded, not returned to the next call.
    assert engine_tp2.collective_rpc(lambda w: ("fresh", w.rank)) == [("fresh", 0), ("fresh", 1)]
    assert len(list(tmp_path.glob("slow-call-done.*"))) == 2
    assert engine_tp2.collective_rpc(lambda w: ("again", w.rank), unique_reply_rank=1) == ("again", 1)
    assert engine_tp2.collective_rpc("check_health", timeout=60) == [True, True]
    engine_tp2.check_health()


def test_large_request_and_result(engine_tp2):
    """Above Ray's inline size the request is put once in the object store for both ranks."""
    payload = os.urandom(4 << 20)
    results = engine_tp2.collective_rpc(lambda w, data: (len(data), data[-16:], bytes([w.rank]) * (3 << 20)),
                                        args=(payload,))
    assert [r[:2] for r in results] == [(len(payload), payload[-16:])] * 2
    assert [r[2] for r in results] == [b"\x00" * (3 << 20), b"\x01" * (3 << 20)]


def _barrier_on_rank_1(worker):
    import torch.distributed as dist

    if worker.rank == 1:
        dist.barrier()  # meets the barrier rank 0 still waits in
    return worker.rank


@pytest.mark.slow
def test_failure_on_a_rank_that_was_not_asked_is_reported_at_once(engine_tp2, hf_tokens):
    start = time.monotonic()
    with pytest.raises(RemoteWorkerError, match="boom on rank 1") as info:
        engine_tp2.collective_rpc(fail_on_rank_1_while_rank_0_waits, unique_reply_rank=0, timeout=120)
    assert info.value.rank == 1
    assert "fail_on_rank_1_while_rank_0_waits" in info.value.remote_traceback
    assert time.monotonic() - start < DEATH_BOUND_S
    # Release rank 0 from its barrier; the engine is whole again.
    assert engine_tp2.collective_rpc(_barrier_on_rank_1, timeout=60) == [0, 1]
    assert tokens_of(engine_tp2) == hf_tokens("llama")


def _rank_actors() -> set[psutil.Process]:
    """Live processes of rank actors (Ray titles them after the class)."""
    found = set()
    for proc in ray_descendants(os.getpid()):
        try:
            if "RayWorkerWrapper" in " ".join(proc.cmdline()):
                found.add(proc)
        except psutil.Error:
            pass
    return found


@pytest.mark.slow
def test_failed_start_up_leaves_no_actor_or_placement_group(engine_tp2, copy_model):
    model = copy_model("llama")
    shard = model / "model-00002-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    actors_before, cpus_before = _rank_actors(), ray.available_resources().get("CPU")
    groups_before = set(ray.util.placement_group_table())
    with pytest.raises(WorkerStartupError) as info:
        EngineCore(ray_config(model))
    msg = str(info.value)
    assert str(shard) in msg and "truncated" in msg, msg
    assert "remote traceback" in msg and "load_model" in msg and LOCAL_IP in msg, msg
    assert_gone(_rank_actors() - actors_before, "actors of the failed start-up")
    new_groups = {k: v for k, v in ray.util.placement_group_table().items() if k not in groups_before}
    assert new_groups and all(g["state"] == "REMOVED" for g in new_groups.values()), new_groups
    deadline = time.monotonic() + DEATH_BOUND_S  # the GCS frees removed bundles asynchronously
    while ray.available_resources().get("CPU") != cpus_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == cpus_before


@pytest.mark.slow
def test_a_placement_the_cluster_cannot_satisfy_fails_naming_the_resources(engine_tp2, tiny_models, monkeypatch):
    """STRICT_SPREAD needs a node per rank; the local instance is one node."""
    import executor.ray_distributed_executor as ray_executor

    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 2.0)
    groups_before = set(ray.util.placement_group_table())
    with pytest.raises(WorkerStartupError, match=r"could not place 2 bundle\(s\) of \{'CPU': 1.0\} \(STRICT_SPREAD\)"
                       r".*on 1 node\(s\)"):
        EngineCore(ray_config(tiny_models["llama"], ray_placement_strategy="STRICT_SPREAD"))
    new_groups = {k: v for k, v in ray.util.placement_group_table().items() if k not in groups_before}
    assert new_groups and all(g["state"] == "REMOVED" for g in new_groups.values()), new_groups


@pytest.mark.slow
def test_two_engines_share_a_cluster_without_interfering(engine_tp2, local_ray, tiny_models, hf_tokens):
    with EngineCore(ray_config(tiny_models["qwen2"])) as other:
        local_ray.record()
        other_actors = processes(actor_pids(other))
        assert not set(actor_pids(other)) & set(actor_pids(engine_tp2))
        assert other.model_executor._placement_group.id != engine_tp2.model_executor._placement_group.id
        # At the same time, then one after the other.
        with ThreadPoolExecutor(2) as pool:
            first, second = pool.submit(tokens_of, engine_tp2), pool.submit(tokens_of, other)
            assert first.result() == hf_tokens("llama")
            assert second.result() == hf_tokens("qwen2")
        assert tokens_of(other) == hf_tokens("qwen2")
        assert tokens_of(engine_tp2) == hf_tokens("llama")
    assert_gone(other_actors, "actors of the engine that was shut down")
    assert tokens_of(engine_tp2) == hf_tokens("llama")
    assert engine_tp2.collective_rpc("check_health") == [True, True]


def _busy_on(rank: int) -> Callable[[Any], int]:
    def busy(worker):
        time.sleep(60 if worker.rank == rank else 0)
        return worker.rank

    return busy


@pytest.mark.slow
@pytest.mark.parametrize("how,victim", [("ray.kill", 1), ("os.kill", 0)])
def test_killed_actor_makes_the_engine_dead_at_once(local_ray, tiny_models, how, victim):
    core = EngineCore(ray_config(tiny_models["llama"]))
    local_ray.record()
    try:
        pids, node = actor_pids(core), core.model_executor.nodes[victim]
        actors = processes(pids)
        # A call is in flight on the survivor when the victim dies.
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(core.collective_rpc, _busy_on(1 - victim), timeout=120)
            time.sleep(0.5)
            if how == "ray.kill":
                ray.kill(core.model_executor.actors[victim])
            else:
                os.kill(pids[victim], signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(EngineDeadError) as info:
                in_flight.result(timeout=2 * DEATH_BOUND_S)
            noticed_after = time.monotonic() - killed_at
        assert noticed_after < DEATH_BOUND_S, f"the dead rank was noticed only after {noticed_after:.1f}s"
        msg = str(info.value)
        assert f"rank {victim}" in msg and node.node_id in msg and node.node_ip in msg and str(node.pid) in msg, msg
        # Dead for good: every later call fails at once with the same reason.
        for call in (lambda: core.collective_rpc(lambda w: w.rank), core.check_health,
                     lambda: core.collective_rpc("check_health", unique_reply_rank=1 - victim)):
            with pytest.raises(EngineDeadError, match=f"rank {victim}"):
                call()
    finally:
        core.shutdown()
    assert_gone(actors, "actors of the killed engine")


def test_ray_processes_talk_over_loopback_only(engine_tp2, local_ray):
    local_ray.record()
    assert engine_tp2.collective_rpc("check_health") == [True, True]
    assert outside_loopback_peers(local_ray.seen | processes([os.getpid()])) == []


# ---------------------------------------------------------------- configuration


def test_without_ray_the_error_says_how_to_install(tiny_models, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ImportError, match=r'pip install -e "\.\[ray\]"'):
        EngineCore(ray_config(tiny_models["llama"]))


def test_placement_strategy_is_validated_and_has_a_flag(tiny_models):
    assert ray_config(tiny_models["llama"]).parallel_config.ray_placement_strategy == "PACK"
    config = ray_config(tiny_models["llama"], ray_placement_strategy="SPREAD")
    assert config.parallel_config.ray_placement_strategy == "SPREAD"
    with pytest.raises(ConfigError, match=r"ray_placement_strategy='spread'.*\['PACK', 'SPREAD'"):
        ray_config(tiny_models["llama"], ray_placement_strategy="spread")
    args = build_parser().parse_args(["--distributed-executor-backend", "ray", "--ray-placement-strategy", "SPREAD"])
    assert (args.distributed_executor_backend, args.ray_placement_strategy) == ("ray", "SPREAD")
    for bad in (["--ray-placement-strategy", "ANY"], ["--distributed-executor-backend", "nope"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


def test_node_local_ranks_count_per_node_in_rank_order():
    assert node_local_ranks(["a", "a"]) == [(0, 2), (1, 2)]
    assert node_local_ranks(["a", "b"]) == [(0, 1), (0, 1)]
    assert node_local_ranks(["a", "a", "b", "b", "b"]) == [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]


@pytest.mark.slow
def test_choosing_the_backend_does_not_import_ray():
    script = textwrap.dedent("""
        import sys
        from executor.registry import get_executor_backend_cls
        assert get_executor_backend_cls("ray").__name__ == "RayDistributedExecutor"
        assert "ray" not in sys.modules, "ray was imported before an engine asked for it"
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- a cluster of two nodes


class _Driver:
    """tests/ray_cluster_driver.py as a subprocess; `result(step)` reads its next report."""

    def __init__(self, model: Path, head: RayNode) -> None:
        env = {**os.environ, **RAY_TEST_ENV, "RAY_TMPDIR": head.temp_root, "TP_RAY_NODE_IP": HEAD_IP,
               "PYTHONPATH": str(REPO)}
        env.pop("RAY_ADDRESS", None)
        script = str(REPO / "tests" / "ray_cluster_driver.py")
        self.proc = subprocess.Popen([sys.executable, script, str(model), head.address], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.proc.stdout, selectors.EVENT_READ)
        self.output: list[str] = []

    def result(self, step: str, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.selector.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line)
            if line.startswith("RESULT "):
                report = json.loads(line[len("RESULT "):])
                assert report["step"] == step, "".join(self.output[-40:])
                return report
        raise AssertionError(f"no {step!r} report from the driver; its output:\n{''.join(self.output[-60:])}")

    def finish(self) -> int:
        try:
            rest, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rest, _ = self.proc.communicate()
        self.output.append(rest)
        return self.proc.returncode


def _wait_for_log(node: RayNode, text: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in node.log():
        assert node.proc.poll() is None and time.monotonic() < deadline, f"Ray node {node.ip}:\n{node.log()}"
        time.sleep(0.2)


@pytest.mark.slow
def test_two_node_cluster_spreads_the_ranks_and_survives_losing_a_node(ray_env, tiny_models, hf_tokens):
    head = RayNode(HEAD_IP, num_cpus=1)
    second = None
    try:
        second = RayNode(NODE2_IP, num_cpus=1, head_address=head.address)
        _wait_for_log(second, "Ray runtime started")
        driver = _Driver(tiny_models["llama"], head)
        spread = driver.result("spread")
        # It found the head through the address `ray start --head` recorded.
        assert any(f"joined the cluster at {head.address} (recorded by `ray start --head`)" in m
                   for m in spread["log"]), spread["log"]
        head.record()
        second.record()
        # One rank per node, as each actor itself reports, numbered engine node first.
        ranks, placed = spread["ranks"], spread["placed"]
        assert [p["node_ip"] for p in placed] == [HEAD_IP, NODE2_IP]
        assert [r["node_id"] for r in ranks] == [p["node_id"] for p in placed]
        assert len({r["node_id"] for r in ranks}) == 2
        assert [(r["local_rank"], r["local_world_size"]) for r in ranks] == [(0, 1), (0, 1)]
        assert spread["tokens"] == hf_tokens("llama")[:2]
        assert outside_loopback_peers(head.seen | second.seen) == []
        # A joined cluster outlives the engine; only its placement group and actors go.
        after = driver.result("after_shutdown")
        assert not after["still_connected"] and after["pg_state"] == "REMOVED"
        assert after["alive_nodes"] == 2 and after["free_cpus"] == after["total_cpus"] == 2.0

        lost = driver.result("ready_to_lose_node")
        assert [p["node_ip"] for p in lost["placed"]] == [HEAD_IP, NODE2_IP]
        assert any(f"joined the cluster at {head.address} (RAY_ADDRESS)" in m for m in lost["log"]), lost["log"]
        time.sleep(0.5)  # let the call reach rank 0
        head.record()
        second.record()
        assert outside_loopback_peers(head.seen | second.seen) == []
        second.kill()
        killed_at = time.monotonic()
        dead = driver.result("dead", timeout=60)
        noticed_after = time.monotonic() - killed_at
        assert noticed_after < DEATH_BOUND_S, f"the lost node was noticed only after {noticed_after:.1f}s"
        node2 = lost["placed"][1]
        for msg in (dead["error"], dead["later"]):
            assert msg and "rank 1" in msg and node2["node_id"] in msg and NODE2_IP in msg, msg
        assert driver.finish() == 0, "".join(driver.output[-60:])
    finally:
        if second is not None:
            second.stop()
        head.stop()


# ---------------------------------------------------------------- no cluster: the engine starts one


@pytest.mark.slow
def test_serve_with_no_cluster_starts_a_local_instance_and_stops_it(ray_env, tmp_path):
    model = tiny_llama_with_tokenizer(tmp_path / "model", num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=512, max_position_embeddings=256)
    ray_tmp = short_temp_dir()
    server = ServerProcess(
        [str(model), "--tp", "2", "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "4MiB",
         "--max-model-len", "128", "--distributed-executor-backend", "ray", "--no-access-log"],
        tmp_path / "server.log", env={**RAY_TEST_ENV, "TP_RAY_NODE_IP": SERVE_IP, "RAY_TMPDIR": ray_tmp},
    )
    try:
        server.start()
        ray_procs = ray_descendants(server.pid)
        assert "started a local instance" in server.log(), server.log()
        body = {"model": str(model), "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 6
        ray_procs |= ray_descendants(server.pid)
        assert len(ray_procs) >= 4, ray_procs  # GCS, raylet, and the two rank actors at least
        assert outside_loopback_peers(ray_procs | processes([server.pid])) == []
        server.stop()
        assert server.wait(timeout=30) == 0, server.log()
        assert_gone(ray_procs, "the local instance `engine.serve` started")
    finally:
        server.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
