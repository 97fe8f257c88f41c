"""distributed_executor_backend="external_launcher": every rank a torchrun process with
its own EngineCore (real `python -m torch.distributed.run` processes, CPU, gloo and the
shared-memory communicator, loopback only).

- the torchrun environment is checked before anything starts, naming what is wrong;
- programmatic use, one node with 2 processes and two nodes with 1 each (c10d
  rendezvous): every rank gets the multiprocess backend's tokens, greedy and sampled,
  and the same KV block count;
- `engine.serve` under torchrun: rank 0 serves /v1/completions with the multiprocess
  backend's tokens and rank 1 listens on no HTTP port; SIGTERM of rank 0, SIGTERM of
  torchrun (with a request in flight, which finishes), SIGKILL of torchrun and SIGKILL
  of rank 0 all end every rank, and nothing of ours is left behind.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from tokenizers import Tokenizer

from config import SamplingParams
from engine.core import EngineCore
from executor.abstract import Executor
from executor.external_launcher_executor import ExternalLauncherExecutor, LauncherEnvError, read_torchrun_env
from tests import external_launcher_generate as script
from tests.conftest import tiny_llama_with_tokenizer
from tests.runtime_helpers import KV_BYTES, engine_config, live_children, shm_segments
from tests.torchrun_helpers import (
    Torchrun,
    free_port,
    listening_ports,
    new_run_id,
    our_shm_segments,
    ours_left_in,
    single_node_args,
    two_node_args,
    wait_gone,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Liveness bounds, not performance: how long a start or a stop may take before the
# test reports it as hung.
READY_BOUND_S = 180.0
EXIT_BOUND_S = 60.0
SERVE_PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def mp_reference(tiny_models: dict[str, Path]) -> dict[str, Any]:
    """What the multiprocess backend generates for the script's prompts at TP=2."""
    with EngineCore(engine_config(tiny_models["llama"], tp=2, distributed_executor_backend="mp")) as core:
        greedy = core.generate(script.PROMPTS, script.GREEDY)
        sampled = core.generate(script.PROMPTS[:2], script.SAMPLED)
        return {"num_blocks": core.kv_cache_config.num_blocks,
                "greedy": [o.token_ids for o in greedy], "sampled": [o.token_ids for o in sampled]}


@pytest.fixture
def torchruns(tmp_path: Path) -> Iterator[list[Torchrun]]:
    """Torchrun processes a test starts; whatever is left of them is killed after it."""
    started: list[Torchrun] = []
    yield started
    for run in started:
        run.kill_all()


def assert_nothing_of_ours_left(runs: list[Torchrun], shm_before: set[str]) -> None:
    for run in runs:
        assert not wait_gone(run.leftovers(), EXIT_BOUND_S), f"still running: {run.leftovers()}\n{run.log()}"
        assert not ours_left_in(run.tmpdir), f"left in TMPDIR: {ours_left_in(run.tmpdir)}"
    leaked = our_shm_segments() - shm_before
    deadline = time.monotonic() + 5.0  # another test run's segment lives only until all its ranks attach
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked &= our_shm_segments()
    assert not leaked, f"shared-memory segments left in /dev/shm: {sorted(leaked)}"


def run_generate_script(torchruns: list[Torchrun], tmp_path: Path, model: Path, launches: list[list[str]],
                        *script_args: str) -> list[dict[str, Any]]:
    """Run tests/external_launcher_generate.py under one torchrun per entry of
    `launches` (torchrun's arguments); returns each rank's result, in rank order."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for i, launcher_args in enumerate(launches):
        target = ["-m", "tests.external_launcher_generate", str(model), str(out_dir), *script_args]
        run = Torchrun(launcher_args, target, tmp_path / f"torchrun{i}.log", tmp_path / f"tmp{i}")
        torchruns.append(run.start())
    for run in torchruns:
        assert run.wait(timeout=READY_BOUND_S) == 0, run.log()
    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    assert [r["rank"] for r in results] == [0, 1]
    return results


# ---------------------------------------------------------------- the environment


@pytest.mark.parametrize("missing", [["RANK"], ["MASTER_ADDR", "MASTER_PORT"]])
def test_missing_torchrun_variables_are_named(missing: list[str]) -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    for name in missing:
        del env[name]
    with pytest.raises(LauncherEnvError, match=f"{', '.join(missing)} .*not set.*torchrun --nproc-per-node 2"):
        read_torchrun_env(2, env)


def test_world_size_must_be_the_tensor_parallel_size() -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    with pytest.raises(LauncherEnvError, match=r"WORLD_SIZE=3 .*tensor_parallel_size=2"):
        read_torchrun_env(2, env)
    with pytest.raises(LauncherEnvError, match=r"RANK='one' is not an integer"):
        read_torchrun_env(2, {**env, "WORLD_SIZE": "2", "RANK": "one"})


def test_engine_outside_torchrun_fails_before_starting_anything(tiny_models, monkeypatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    children_before = live_children()
    config = engine_config(tiny_models["llama"], tp=2, distributed_executor_backend="external_launcher")
    assert Executor.get_class(config) is ExternalLauncherExecutor
    with pytest.raises(LauncherEnvError, match="RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"):
        EngineCore(config)
    assert live_children() == children_before


# ---------------------------------------------------------------- programmatic use


def check_against_mp(results: list[dict[str, Any]], mp_reference: dict[str, Any]) -> None:
    for result in results:
        assert result["greedy"] == mp_reference["greedy"], f"rank {result['rank']}"
        assert result["sampled"] == mp_reference["sampled"], f"rank {result['rank']}"
        # Every rank sized its cache from the one agreed (smallest) budget, the mp engine's.
        assert result["num_blocks"] == mp_reference["num_blocks"]
        assert result["per_rank_timings"] == 2
    assert results[0]["sampled_logprobs"] == results[1]["sampled_logprobs"]
    assert all(len(tokens) == script.GREEDY.max_tokens for tokens in mp_reference["greedy"])


def test_torchrun_two_processes_generate_what_mp_generates(tiny_models, mp_reference, torchruns, tmp_path):
    shm_before = our_shm_segments()
    # Rank 0 may spare twice the budget of rank 1: both must size their cache by rank 1's.
    results = run_generate_script(torchruns, tmp_path, tiny_models["llama"], [single_node_args(2, free_port())],
                                  "--rank0-kv-bytes", str(2 * KV_BYTES))
    check_against_mp(results, mp_reference)
    assert results[0]["pid"] != results[1]["pid"]
    assert_nothing_of_ours_left(torchruns, shm_before)


def test_torchrun_multi_step_decode_generates_what_mp_generates(tiny_models, mp_reference, torchruns, tmp_path):
    """Every rank runs several decode steps per output; each step's tokens are rank 0's
    on every rank (sync_sampled_tokens carries them all)."""
    results = run_generate_script(torchruns, tmp_path, tiny_models["llama"], [single_node_args(2, free_port())],
                                  "--num-scheduler-steps", "4")
    check_against_mp(results, mp_reference)
    assert [r["max_steps"] for r in results] == [4, 4]


def test_ranks_that_add_requests_differently_fail_instead_of_drifting(tiny_models, torchruns, tmp_path):
    shm_before = our_shm_segments()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = ["-m", "tests.external_launcher_generate", str(tiny_models["llama"]), str(out_dir), "--diverge"]
    run = Torchrun(single_node_args(2, free_port()), target, tmp_path / "torchrun.log", tmp_path / "tmp")
    torchruns.append(run.start())
    assert run.wait(timeout=READY_BOUND_S) != 0
    assert "LockstepDivergedError: rank 1 scheduled" in run.log(), run.log()
    assert not list(out_dir.iterdir())
    assert_nothing_of_ours_left(torchruns, shm_before)


def test_two_node_torchrun_generates_what_mp_generates(tiny_models, mp_reference, torchruns, tmp_path):
    shm_before = our_shm_segments()
    port, run_id = free_port(), new_run_id()
    results = run_generate_script(torchruns, tmp_path, tiny_models["llama"],
                                  [two_node_args(0, port, run_id), two_node_args(1, port, run_id)])
    check_against_mp(results, mp_reference)
    assert_nothing_of_ours_left(torchruns, shm_before)


# ---------------------------------------------------------------- engine.serve under torchrun


@pytest.fixture(scope="module")
def serve_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("el_serve") / "tiny", num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                                     init_std=0.1)


@pytest.fixture(scope="module")
def serve_reference(serve_model: Path) -> str:
    """The multiprocess backend's greedy completion of SERVE_PROMPT."""
    shm_before = shm_segments()
    config = engine_config(serve_model, tp=2, distributed_executor_backend="mp", max_model_len=256)
    with EngineCore(config) as core:
        text = core.generate(SERVE_PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
    assert shm_segments() == shm_before
    return text


def start_server(torchruns: list[Torchrun], tmp_path: Path, model: Path, *extra: str) -> tuple[Torchrun, str]:
    """`torchrun --nproc-per-node 2 -m engine.serve ...` until rank 0's /health answers;
    returns the run and rank 0's URL. Ports taken between picking and binding are retried."""
    for attempt in range(3):
        http_port = free_port()
        target = ["-m", "engine.serve", str(model), "--tp", "2", "--device", "cpu", "--dtype", "float32",
                  "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--served-model-name", "tiny-serve",
                  "--no-access-log", "--distributed-executor-backend", "external_launcher",
                  "--port", str(http_port), *extra]
        run = Torchrun(single_node_args(2, free_port()), target, tmp_path / f"serve{attempt}.log",
                       tmp_path / f"serve_tmp{attempt}")
        torchruns.append(run.start())
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + READY_BOUND_S
        while time.monotonic() < deadline and run.proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    assert sorted(run.ranks()) == [0, 1]
                    return run, url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        if "address already in use" not in run.log().lower():
            break
        run.kill_all()
    raise AssertionError(f"torchrun engine.serve did not become ready:\n{run.log()}")


def complete(url: str, prompt: Any, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny-serve", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_serve_rank0_answers_rank1_does_not_listen_sigterm_of_rank0_stops_all(
        serve_model, serve_reference, torchruns, tmp_path):
    shm_before = our_shm_segments()
    run, url = start_server(torchruns, tmp_path, serve_model)
    http_port = int(url.rsplit(":", 1)[1])
    ranks = run.ranks()

    assert complete(url, SERVE_PROMPT)["choices"][0]["text"] == serve_reference
    ids = Tokenizer.from_file(str(serve_model / "tokenizer.json")).encode(SERVE_PROMPT).ids
    assert complete(url, ids)["choices"][0]["text"] == serve_reference
    many = [complete(url, f"{SERVE_PROMPT} {i}") for i in range(3)]  # several steps, several requests
    assert all(r["usage"]["completion_tokens"] == 12 for r in many)

    assert ("127.0.0.1", http_port) in listening_ports(ranks[0])
    rank1_listens = listening_ports(ranks[1])
    assert http_port not in [port for _, port in rank1_listens]
    # What rank 1 does listen on (gloo's pair sockets) is loopback only.
    assert all(ip == "127.0.0.1" for ip, _ in rank1_listens), rank1_listens

    ranks[0].send_signal(signal.SIGTERM)
    assert run.wait(timeout=EXIT_BOUND_S) == 0, run.log()
    log = run.log()
    assert "rank 1: rank 0 shut down" in log and "stopped by SIGTERM" in log, log
    assert_nothing_of_ours_left(torchruns, shm_before)


def test_torchrun_sigterm_lets_the_request_in_flight_finish_then_stops_every_rank(
        serve_model, torchruns, tmp_path):
    shm_before = our_shm_segments()
    run, url = start_server(torchruns, tmp_path, serve_model, "--shutdown-timeout", "60")
    body = {"model": "tiny-serve", "prompt": SERVE_PROMPT, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        events.append(next(lines))  # the request is running on every rank now
        run.proc.send_signal(signal.SIGTERM)  # torchrun passes it to every rank
        events.extend(line for line in lines if line)  # SSE events are separated by empty lines
    payloads = [json.loads(e[len("data: "):]) for e in events if e.startswith("data: ") and e != "data: [DONE]"]
    assert events[-1] == "data: [DONE]"
    assert payloads[-1]["usage"]["completion_tokens"] == 200
    run.wait(timeout=EXIT_BOUND_S)  # torchrun itself exits non-zero after a signal, by its design
    log = run.log()
    assert "rank 1: SIGTERM received" in log and "rank 1: rank 0 shut down" in log, log
    assert "stopped by SIGTERM" in log, log
    assert_nothing_of_ours_left(torchruns, shm_before)


def test_killed_torchrun_takes_every_rank_down_cleanly(serve_model, torchruns, tmp_path):
    shm_before = our_shm_segments()
    run, _ = start_server(torchruns, tmp_path, serve_model)
    ranks = run.ranks()
    run.proc.send_signal(signal.SIGKILL)
    run.wait(timeout=EXIT_BOUND_S)
    # The ranks get SIGTERM from Linux when their parent dies, and stop as at torchrun's own.
    assert not wait_gone([p.pid for p in ranks.values()], EXIT_BOUND_S), run.log()
    log = run.log()
    assert "rank 1: rank 0 shut down" in log and "stopped by SIGTERM" in log, log
    assert_nothing_of_ours_left(torchruns, shm_before)


def test_rank0_death_ends_the_followers(serve_model, torchruns, tmp_path):
    shm_before = our_shm_segments()
    run, url = start_server(torchruns, tmp_path, serve_model)
    served: list[Any] = []
    thread = threading.Thread(target=lambda: served.append(complete(url, SERVE_PROMPT)))
    thread.start()
    thread.join(timeout=120)
    assert served
    run.ranks()[0].kill()
    assert run.wait(timeout=EXIT_BOUND_S) != 0
    assert "rank 1 stops following" in run.log() and "lost rank 0" in run.log(), run.log()
    assert_nothing_of_ours_left(torchruns, shm_before)
