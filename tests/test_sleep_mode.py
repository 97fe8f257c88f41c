"""Sleep mode: sleep(level) hands memory back, wake_up restores it, update_weights swaps
the weights, and nothing hangs or is lost on the way.

Memory is each rank's RSS (the CPU's measure), read by the worker before and after each
call and returned in its report. Weights are compared by a SHA-256 of every parameter's
bytes on every rank. Outputs are greedy tokens of real engines (TP 1 and 2).
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from config import SamplingParams
from engine.core import EngineCore
from engine.tiny_model import make_tiny_model
from tests.test_serve import ServerProcess

pytestmark = pytest.mark.slow

KV_BYTES = 32 << 20
PROMPTS = [list(range(5, 41)), [7, 300, 12, 9, 1000, 4, 4, 81]]
MODEL_SPEC: dict[str, Any] = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
                                  num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=False,
                                  with_tokenizer=False, init_std=0.1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints of one architecture with different weights (~50 MB each)."""
    root = tmp_path_factory.mktemp("sleep_models")
    return (make_tiny_model(root / "a", "llama", seed=11, **MODEL_SPEC),
            make_tiny_model(root / "b", "llama", seed=12, **MODEL_SPEC))


def make_engine(model: Path, tp: int = 1, **kwargs: Any) -> EngineCore:
    return EngineCore(model=str(model), tensor_parallel_size=tp, device="cpu", dtype="float32",
                      kv_cache_memory_bytes=KV_BYTES, max_model_len=256, enable_sleep_mode=True,
                      use_tqdm_on_load=False, **kwargs)


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def generate(core: EngineCore) -> list[list[int]]:
    return [o.token_ids for o in core.generate(PROMPTS, greedy())]


def weights_checksum(worker: Any) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(worker.model_runner.model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("tp", [1, 2])
def test_sleep_frees_memory_and_wake_up_restores_weights_and_outputs(checkpoints: tuple[Path, Path], tp: int) -> None:
    with make_engine(checkpoints[0], tp) as core:
        reference = generate(core)
        checksums = core.collective_rpc(weights_checksum)
        kv_bytes = core.kv_cache_config.num_blocks * core.kv_cache_config.block_bytes
        for level in (1, 2):
            reports = core.sleep(level)
            assert core.is_sleeping and len(reports) == tp
            for report in reports:
                assert report["bytes"]["kv_cache"] == kv_bytes
                expected = kv_bytes
                if level == 2:
                    assert report["bytes"]["weights"] > 0
                    expected += report["bytes"]["weights"]
                else:
                    assert "weights" not in report["bytes"]  # on the CPU they are host memory already
                freed = report["memory_before"] - report["memory_after"]
                assert freed >= expected, f"level {level}, rank {report['rank']}: RSS fell {freed}, not {expected}"
            woken = core.wake_up()
            assert not core.is_sleeping
            for report in woken:
                assert report["bytes"]["kv_cache"] == kv_bytes
                assert ("weights" in report["bytes"]) == (level == 2)
                assert report["state"] == {"weights": "awake", "kv_cache": "awake"}
            assert core.collective_rpc(weights_checksum) == checksums
            assert generate(core) == reference, f"level {level}"


def test_requests_in_flight_finish_first_or_are_aborted(checkpoints: tuple[Path, Path]) -> None:
    with make_engine(checkpoints[0]) as core:
        reference = generate(core)
        ids = [core.add_request(p, greedy()) for p in PROMPTS]
        assert core.step()  # both are running now
        core.sleep(1)
        drained = {o.request_id: o for o in core.step()}  # delivered by the next step
        assert [drained[i].token_ids for i in ids] == reference
        assert all(drained[i].finish_reason == "length" for i in ids)
        core.wake_up()

        ids = [core.add_request(p, greedy()) for p in PROMPTS]
        core.step()
        core.sleep(1, abort=True)
        aborted = {o.request_id: o for o in core.step()}
        assert sorted(aborted) == sorted(ids)
        assert all(o.finished and o.finish_reason == "abort" for o in aborted.values())
        assert not core.has_unfinished_requests()
        core.wake_up()
        assert generate(core) == reference


def test_requests_wait_while_asleep_and_repeated_calls_are_harmless(checkpoints: tuple[Path, Path]) -> None:
    with make_engine(checkpoints[0]) as core:
        reference = generate(core)
        assert core.sleep(1)
        again = core.sleep(1)
        assert all(r["bytes"] == {} for r in again)  # nothing left to free at this level
        request_id = core.add_request(PROMPTS[0], greedy())  # accepted, waits
        assert core.step() == []
        with pytest.raises(RuntimeError, match="sleeping"):
            core.generate(PROMPTS[1], greedy())
        core.wake_up(["weights"])
        assert core.is_sleeping and core.step() == []
        core.wake_up(["kv_cache"])
        assert not core.is_sleeping
        assert core.wake_up() == []
        outputs = {}
        while core.has_unfinished_requests():
            outputs.update({o.request_id: o for o in core.step()})
        assert outputs[request_id].token_ids == reference[0]
        # The prefix cache went with the KV cache: the same prompt again hits only the
        # blocks computed since the wake-up.
        stats = core.scheduler.block_manager.stats
        core.sleep(2)
        core.wake_up()
        hits = stats.hits
        assert generate(core) == reference
        assert stats.hits == hits


def test_level_0_pauses_without_freeing(checkpoints: tuple[Path, Path]) -> None:
    with make_engine(checkpoints[0]) as core:
        reference = generate(core)
        ids = [core.add_request(p, greedy()) for p in PROMPTS]
        core.step()
        assert core.sleep(0) == [] and core.is_sleeping
        assert core.step() == [] and core.has_unfinished_requests()
        core.wake_up()
        outputs = {}
        while core.has_unfinished_requests():
            outputs.update({o.request_id: o for o in core.step()})
        assert [outputs[i].token_ids for i in ids] == reference


def test_bad_sleep_calls_are_refused(checkpoints: tuple[Path, Path]) -> None:
    with make_engine(checkpoints[0]) as core:
        with pytest.raises(ValueError, match="level"):
            core.sleep(3)
        core.sleep(1)
        with pytest.raises(ValueError, match="tags"):
            core.wake_up(["weights", "everything"])
        core.wake_up()
    with EngineCore(model=str(checkpoints[0]), device="cpu", kv_cache_memory_bytes=KV_BYTES, max_model_len=256,
                    use_tqdm_on_load=False) as core:
        with pytest.raises(RuntimeError, match="enable_sleep_mode"):
            core.sleep(1)


@pytest.mark.parametrize("tp", [2])
def test_update_weights_from_a_checkpoint_and_from_tensors(checkpoints: tuple[Path, Path], tp: int) -> None:
    a, b = checkpoints
    with make_engine(b, tp) as fresh_b:
        expected_b = generate(fresh_b)
    with make_engine(a, tp) as core:
        expected_a = generate(core)
        assert expected_a != expected_b
        core.update_weights(b)
        assert generate(core) == expected_b
        # A level-2 wake-up reloads the checkpoint last loaded, not the original one.
        core.sleep(2)
        core.wake_up()
        assert generate(core) == expected_b
        # Named, unsharded tensors, as an RL trainer sends them.
        tensors = {}
        for shard in sorted(a.glob("*.safetensors")):
            tensors.update(load_file(shard))
        core.update_weights(tensors)
        assert generate(core) == expected_a
        with pytest.raises(ValueError, match="not a checkpoint directory"):
            core.update_weights(a / "missing")


def test_server_sleep_routes(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    args = [str(checkpoints[0]), "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "32MiB",
            "--max-model-len", "256", "--served-model-name", "m", "--no-access-log", "--enable-sleep-mode"]
    server = ServerProcess(args, tmp_path / "server.log").start()
    try:
        url = server.url
        body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        reference = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
        slept = httpx.post(f"{url}/sleep", params={"level": 1}, timeout=60)
        assert slept.status_code == 200, slept.text
        assert slept.json()["is_sleeping"] and slept.json()["ranks"][0]["bytes"]["kv_cache"] > 0
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
        result: dict[str, Any] = {}

        def send() -> None:
            result["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        waiting = threading.Thread(target=send)
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive(), "a request sent while asleep must wait for the wake-up"
        woke = httpx.post(f"{url}/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")], timeout=60)
        assert woke.status_code == 200 and not woke.json()["is_sleeping"]
        waiting.join(timeout=60)
        assert result["response"].status_code == 200
        assert result["response"].json()["choices"][0]["text"] == reference
        bad = httpx.post(f"{url}/sleep", params={"level": 3})
        assert bad.status_code == 400 and "level" in bad.json()["error"]["message"]
        assert httpx.post(f"{url}/wake_up", params={"tags": "gpu"}).status_code == 400
    finally:
        server.stop()
    assert "sleep(level=1) rank 0: kv_cache" in server.log()
