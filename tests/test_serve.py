"""End-to-end tests of `python -m engine.serve`: real server subprocesses on loopback,
driven by the official `openai` client and raw httpx.

One TP=2 server serves most tests (start-up is the slow part on a small CPU host);
the tests that stop or break a server start their own. The checkpoint is a tiny random
llama with a tokenizer and chat template, written once per session.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from tests.conftest import REPO, free_port

MODEL_NAME = "tiny-serve"
MODEL_ALIAS = "tiny-alias"  # the shared server's second --served-model-name
MAX_MODEL_LEN = 256
STARTUP_TIMEOUT_S = 180.0
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "What is the capital of France?",
    "Hello, world! This is",
    "The children walked to school",
    "numbers 0 1 2 3",
    "def main():",
    "Every morning the",
    "How many days are in a week?",
    "the stars, the moon,",
    "A tiny language model",
    "Can you help me?",
    "import os, sys;",
    "people who lived there",
    "told stories about the sea",
    "User: Of course",
]


@pytest.fixture(scope="session")
def tokenizer(serve_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(serve_model / "tokenizer.json"))


class ServerProcess:
    """One `python -m engine.serve` subprocess; its output goes to a log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> ServerProcess:
        for _ in range(3):  # the free port can be taken between picking and binding
            self.port = free_port()
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "engine.serve", *self.args, "--port", str(self.port)],
                    cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            if self._wait_ready():
                return self
            if "address already in use" not in self.log().lower():
                break
        raise AssertionError(f"server did not become ready; exit code {self.proc.poll()}; log:\n{self.log()}")

    def _wait_ready(self) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.kill()
        return False

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            children = _descendants(self.proc.pid)
            self.proc.kill()
            self.proc.wait(timeout=30)
            for child in children:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not go within 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _server_args(model: Path, *extra: str, tp: int = 2) -> list[str]:
    return [str(model), "--tp", str(tp), "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL_NAME, "--no-access-log", *extra]


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Any]:
    """start_server(args, env=None) -> a ready ServerProcess, stopped after the test."""
    servers: list[ServerProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(args, tmp_path / f"server{len(servers)}.log", env)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


def _vllm_style_server_args(model: Path, chat_template: Path) -> list[str]:
    """The shared server's command line, in vLLM's spellings (the other servers use ours:
    --tp, --kv-cache-memory, --no-access-log). --tokenizer and --chat-template name the
    model's own, so the rendering the chat tests expect is unchanged."""
    return ["--model", str(model), "-tp", "2", "--device", "cpu", "--dtype", "float", "--kv-cache-memory-bytes",
            "16MiB", "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL_NAME, MODEL_ALIAS,
            "--disable-uvicorn-access-log", "--enforce-eager", "--disable-log-requests", "--block-size", "16",
            "--max-num-batched-tokens", "2K", "--enable-prefix-caching", "--gpu-memory-utilization", "0.9",
            "--generation-config", "vllm", "--max-logprobs", "20", "--uvicorn-log-level", "info",
            "--tokenizer", str(model), "--chat-template", str(chat_template)]


@pytest.fixture(scope="module")
def server(serve_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shared TP=2 server."""
    logs = tmp_path_factory.mktemp("serve_log")
    template = logs / "template.jinja"
    template.write_text(json.loads((serve_model / "tokenizer_config.json").read_text())["chat_template"])
    # A 1 s stats interval, so that test_prefix_cache_metrics_reset_and_log_line sees the line.
    proc = ServerProcess(_vllm_style_server_args(serve_model, template), logs / "server.log",
                         env={"TP_LOG_STATS_INTERVAL": "1"}).start()
    yield proc
    proc.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of sample `name` (e.g. "tp_runtime:prompt_tokens_total") whose labels
    include `labels`, in Prometheus text `text`; every sample must carry model_name."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                assert sample.labels.get("model_name") == MODEL_NAME, sample
                return sample.value
    raise AssertionError(f"metric {name}{labels or ''} not found in:\n{text}")


def _sse_payloads(body: str) -> list[Any]:
    events = [line[len("data: "):] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


# --------------------------------------------------------------------------- completions


@pytest.mark.slow
def test_completion_stream_and_non_stream_agree(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.model == MODEL_NAME
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_prompt_as_token_ids_matches_text_prompt(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    prompt = "Once upon a time there was"
    ids = tokenizer.encode(prompt).ids  # with BOS, as the server encodes text
    kwargs = dict(model=MODEL_NAME, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt=prompt, **kwargs)
    by_ids = client.completions.create(prompt=ids, **kwargs)
    by_list = client.completions.create(prompt=[prompt], **kwargs)
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text == by_list.choices[0].text


def test_logprobs_are_consistent_streaming_or_not(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="What is the capital of France?", max_tokens=10, temperature=0,
                  logprobs=3, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    lp = full.choices[0].logprobs
    n = full.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n == 10
    for token_logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert token_logprob <= 0
        assert 1 <= len(top) <= 4
        # Greedy: the sampled token is the most likely one.
        assert token_logprob == pytest.approx(max(top.values()), abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    chunks = list(client.completions.create(**kwargs, stream=True))
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    logprobs = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
    offsets = [t for c in chunks for t in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens
    assert logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert offsets == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_chat_completion(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    kwargs = dict(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert full.object == "chat.completion"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 8
    rendered = "<s>system: Be brief.\nuser: Hello\nassistant:"  # the tiny model's template
    assert full.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False).ids)

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"

    with_logprobs = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == 8 and all(len(t.top_logprobs) == 2 for t in content)
    assert with_logprobs.choices[0].message.content == choice.message.content


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, MODEL_ALIAS]


def test_every_served_name_is_the_model_and_the_first_is_reported(client: openai.OpenAI) -> None:
    kwargs = dict(prompt="The quick brown fox", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    by_name = client.completions.create(model=MODEL_NAME, **kwargs)
    by_alias = client.completions.create(model=MODEL_ALIAS, **kwargs)
    assert by_alias.model == MODEL_NAME
    assert by_alias.choices[0].text == by_name.choices[0].text
    chat = client.chat.completions.create(model=MODEL_ALIAS, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2)
    assert chat.model == MODEL_NAME


def test_version_and_ping(server: ServerProcess) -> None:
    from importlib.metadata import version

    assert httpx.get(f"{server.url}/version").json() == {"version": version("tp-runtime")}
    for method in ("GET", "POST"):
        response = httpx.request(method, f"{server.url}/ping")
        assert response.status_code == 200 and response.json() == {"status": "ok"}, method


def test_start_up_log_lines(server: ServerProcess) -> None:
    log = server.log()
    config = next(x for x in log.splitlines() if "with config:" in x)
    for part in ("architecture=LlamaForCausalLM", "dtype=torch.float32", f"max_model_len={MAX_MODEL_LEN}",
                 "tensor_parallel_size=2", "distributed_executor_backend=mp", "load_format=auto",
                 f"served_model_name=['{MODEL_NAME}', '{MODEL_ALIAS}']"):
        assert part in config, (part, config)
    memory = next(x for x in log.splitlines() if "Memory per rank:" in x)
    assert "rank 0: weights " in memory and "rank 1: weights " in memory and " GiB" in memory, memory
    assert "KV cache 0.0156 GiB each" in memory, memory  # 16 MiB per rank
    size = next(x for x in log.splitlines() if "KV cache size:" in x)
    num_tokens = int(size.split("KV cache size: ")[1].split(" tokens")[0].replace(",", ""))
    concurrency = float(size.split("per request: ")[1].rstrip("x"))
    assert f"maximum concurrency for {MAX_MODEL_LEN} tokens per request" in size
    assert concurrency == pytest.approx(num_tokens / MAX_MODEL_LEN, abs=0.01)
    ready = next(x for x in log.splitlines() if "EngineCore ready in" in x)
    assert "rank 0: distributed_init " in ready and "rank 1: distributed_init " in ready, ready
    assert ", load " in ready.split("per rank: ")[1] and "{" not in ready, ready  # formatted, not a dict


# ------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo, to score the prompt
        ({"logprobs": 1000}, "logprobs"),
        ({"prompt": "word " * 300}, "prompt"),  # longer than max_model_len
        ({"prompt": list(range(MAX_MODEL_LEN - 4)), "max_tokens": 16}, "prompt"),  # prompt + max_tokens too long
        ({"prompt": [1, 2, 10**6]}, "prompt"),  # outside the vocabulary
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", []]}, "prompt"),  # a list mixing text and ids
        ({"prompt": {"text": "hi"}}, "prompt"),  # wrong types
        ({"max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
    ],
)
def test_bad_completion_request_is_a_400(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    request = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=request, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_server_survives_bad_requests(server: ServerProcess, client: openai.OpenAI) -> None:
    url = f"{server.url}/v1/completions"
    assert httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    assert httpx.post(url, json=["a list"]).status_code == 400
    unknown_model = httpx.post(url, json={"model": "nope", "prompt": "hi"})
    assert unknown_model.status_code == 404 and unknown_model.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", n=2, best_of=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=0)
    assert httpx.get(f"{server.url}/health").status_code == 200
    ok = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3


# ------------------------------------------------------------------ concurrency, metrics


@pytest.mark.slow
def test_64_concurrent_requests_match_sequential_ones(server: ServerProcess) -> None:
    url = f"{server.url}/v1/completions"
    cases = [(PROMPTS[i % len(PROMPTS)], 8 + 4 * (i % 3), i % 2 == 1) for i in range(64)]  # prompt, max_tokens, stream

    def body(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
        return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}

    def result(response: httpx.Response, stream: bool) -> tuple[str, str | None]:
        assert response.status_code == 200, response.text
        if not stream:
            choice = response.json()["choices"][0]
            return choice["text"], choice["finish_reason"]
        chunks = [p["choices"][0] for p in _sse_payloads(response.text)]
        return "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]

    with httpx.Client(timeout=120) as http:
        reference = {(p, m): result(http.post(url, json=body(p, m, False)), False)
                     for p, m in sorted({(p, m) for p, m, _ in cases})}

    async def run_all() -> list[tuple[str, str | None]]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            responses = await asyncio.gather(*(http.post(url, json=body(*case)) for case in cases))
        return [result(r, stream) for r, (_, _, stream) in zip(responses, cases)]

    results = asyncio.run(run_all())
    for (prompt, max_tokens, stream), got in zip(cases, results):
        assert got == reference[(prompt, max_tokens)], (prompt, max_tokens, stream)


@pytest.mark.slow
def test_health_and_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    before = httpx.get(f"{server.url}/metrics")
    client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5, extra_body={"ignore_eos": True})
    after = httpx.get(f"{server.url}/metrics")
    assert after.status_code == 200 and after.headers["content-type"].startswith("text/plain")
    text = after.text
    for name, grew_by in (("tp_runtime:requests_received_total", 1), ("tp_runtime:generation_tokens_total", 5),
                          ("tp_runtime:e2e_request_latency_seconds_count", 1),
                          ("tp_runtime:time_to_first_token_seconds_count", 1),
                          ("tp_runtime:inter_token_latency_seconds_count", 4),
                          ("tp_runtime:request_queue_time_seconds_count", 1),
                          ("tp_runtime:request_decode_time_seconds_count", 1),
                          ("tp_runtime:request_generation_tokens_sum", 5)):
        assert _metric(text, name) >= _metric(before.text, name) + grew_by, name
    assert _metric(text, "tp_runtime:prompt_tokens_total") > 0
    assert _metric(text, "tp_runtime:request_success_total", finished_reason="length") >= 1
    assert _metric(text, "tp_runtime:requests_rejected_total") >= 0
    assert _metric(text, "tp_runtime:num_requests_running") == 0
    assert _metric(text, "tp_runtime:num_requests_waiting") == 0
    assert _metric(text, "tp_runtime:num_preemptions_total") == 0
    assert 0.0 <= _metric(text, "tp_runtime:kv_cache_usage_perc") <= 1.0
    assert _metric(text, "tp_runtime:engine_step_seconds_count") > 0
    assert "# TYPE tp_runtime:time_to_first_token_seconds histogram" in text
    assert "# TYPE tp_runtime:engine_step_seconds histogram" in text
    # One prefill step, then a step per further token: each step's tokens are observed.
    for name in ("tp_runtime:iteration_tokens_total_count", "tp_runtime:iteration_tokens_total_sum"):
        assert _metric(text, name) >= _metric(before.text, name) + 5, name
    # vLLM's cache_config_info: labelled with the cache config (and engine), no model_name.
    info = next(s for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "tp_runtime:cache_config_info")
    assert info.value == 1 and info.labels["engine"] == "0", info
    assert (info.labels["block_size"], info.labels["enable_prefix_caching"], info.labels["cache_dtype"]) == (
        "16", "True", "float32"), info
    assert int(info.labels["num_gpu_blocks"]) > 0 and info.labels["kv_cache_memory_bytes"] == str(16 << 20), info


@pytest.mark.slow
def test_prefix_cache_metrics_reset_and_log_line(server: ServerProcess, client: openai.OpenAI) -> None:
    prompt = "A long shared system prompt, " * 6 + "and then a question"

    def hits() -> float:
        return _metric(httpx.get(f"{server.url}/metrics").text, "tp_runtime:prefix_cache_hits_total")

    def complete() -> str:
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True})
        return out.choices[0].text

    first = complete()
    start = hits()
    assert complete() == first
    assert hits() >= start + 16  # at least one whole block of the repeated prompt
    reset = httpx.post(f"{server.url}/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json()["num_blocks_dropped"] > 0
    after_reset = hits()
    assert complete() == first
    assert hits() == after_reset
    queries = _metric(httpx.get(f"{server.url}/metrics").text, "tp_runtime:prefix_cache_queries_total")
    assert queries >= hits()
    deadline = time.monotonic() + 30
    while "Prefix cache hit rate:" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    line = next(x for x in server.log().splitlines() if "Prefix cache hit rate:" in x)
    assert line.split("engine.stats: ")[1].startswith("Engine 000: Avg prompt throughput: ")
    for part in ("Avg generation throughput:", "Running:", "Waiting:", "CPU KV cache usage:"):
        assert part in line, (part, line)


@pytest.mark.slow
def test_client_disconnect_aborts_the_request(server: ServerProcess) -> None:
    def aborted() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return _metric(text, "tp_runtime:request_success_total", finished_reason="abort")

    def running() -> float:
        return _metric(httpx.get(f"{server.url}/metrics").text, "tp_runtime:num_requests_running")

    start = aborted()
    long = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    # logprobs: every token makes an event (a token's text alone may be empty).
    stream = {**long, "stream": True, "logprobs": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=stream, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the stream started; now hang up
    deadline = time.monotonic() + 30
    while (aborted() < start + 1 or running() > 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted() == start + 1 and running() == 0
    # A plain request: hang up once the engine runs it (not after a guess at how long
    # 240 tokens take, which a faster engine beat).
    body = json.dumps(long).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while running() < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert running() == 1
    deadline = time.monotonic() + 30
    while aborted() < start + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert aborted() == start + 2, httpx.get(f"{server.url}/metrics").text
    metrics = httpx.get(f"{server.url}/metrics").text
    assert _metric(metrics, "tp_runtime:num_requests_running") == 0


# -------------------------------------------------------- AsyncEngine, in process


def _in_process_core(model: Path) -> Any:
    from engine.core import EngineCore

    return EngineCore(model=str(model), tensor_parallel_size=1, device="cpu", dtype="float32",
                      kv_cache_memory_bytes=16 << 20, max_model_len=MAX_MODEL_LEN, use_tqdm_on_load=False)


@pytest.mark.slow
def test_async_engine_generates_cancels_and_dies_cleanly(serve_model: Path) -> None:
    from config import SamplingParams
    from engine.async_engine import AsyncEngine
    from executor.errors import EngineDeadError

    core = _in_process_core(serve_model)
    engine = AsyncEngine(core, health_check_interval_s=0.1)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def collect(prompt: str, params: SamplingParams = greedy) -> list[Any]:
        return [out async for out in engine.generate(prompt, params)]

    async def scenario() -> None:
        outputs = await collect("Hello")
        # Cumulative: each output extends the one before; a reader that fell behind
        # gets the newest one queued (a loaded host skips some), never an older one.
        lengths = [len(o.token_ids) for o in outputs]
        assert lengths == sorted(set(lengths)) and lengths[-1] == 8, lengths
        assert all(o.token_ids == outputs[-1].token_ids[: len(o.token_ids)] for o in outputs)
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        together = await asyncio.gather(*(collect(p) for p in PROMPTS[:6]))
        alone = [await collect(p) for p in PROMPTS[:6]]
        assert [o[-1].token_ids for o in together] == [o[-1].token_ids for o in alone]

        with pytest.raises(ValueError, match="prompt"):
            await collect("word " * 300)  # refused by the core; the engine goes on

        # Cancelled once its first output is in: never after it finished, however fast the host.
        started = asyncio.Event()

        async def stream() -> None:
            async for _ in engine.generate("Hello", SamplingParams(max_tokens=200, ignore_eos=True)):
                started.set()

        task = asyncio.ensure_future(stream())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the abort reaches the loop thread within a step or two
            if not core.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        assert not core.has_unfinished_requests()
        assert engine.metrics.requests_finished["abort"] == 1

        # A worker failure mid-request: the pending request gets the error, nothing hangs.
        def dead_step() -> Any:
            raise EngineDeadError("worker rank 0 died (simulated)")

        core.step = dead_step  # type: ignore[method-assign]
        with pytest.raises(EngineDeadError, match="simulated"):
            await collect("Hello")
        assert engine.dead_event.wait(5) and engine.errored
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            await collect("Hello")

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_async_engine_gives_a_slow_reader_every_delta(serve_model: Path) -> None:
    """DELTA outputs are never skipped for being queued behind each other: a reader that
    sleeps after each one still gets every token, in order, and the token count."""
    from config import RequestOutputKind, SamplingParams
    from engine.async_engine import AsyncEngine

    core = _in_process_core(serve_model)
    engine = AsyncEngine(core, health_check_interval_s=0.1)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    deltas = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def scenario() -> tuple[list[Any], list[Any]]:
        whole = [out async for out in engine.generate("Hello", params)]
        pieces = []
        async for out in engine.generate("Hello", deltas):
            pieces.append(out)
            await asyncio.sleep(0.05)  # several steps queue up behind this one
        return whole, pieces

    try:
        whole, pieces = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert len(pieces) == 12 and all(len(p.token_ids) == 1 for p in pieces)
    assert [t for p in pieces for t in p.token_ids] == whole[-1].token_ids
    assert pieces[-1].finished and not any(p.finished for p in pieces[:-1])
    assert engine.metrics.generation_tokens == 12 + 12


def test_async_engine_shutdown_fails_pending_requests(serve_model: Path) -> None:
    from config import SamplingParams
    from engine.async_engine import AsyncEngine, EngineShutdownError

    engine = AsyncEngine(_in_process_core(serve_model))

    async def scenario() -> None:
        stream = await engine.add_request("Hello", SamplingParams(max_tokens=240, ignore_eos=True))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineShutdownError):
            async for _ in stream:
                pass
        with pytest.raises(EngineShutdownError):
            await engine.add_request("Hello")

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


# --------------------------------------------------------------------- own servers


@pytest.mark.slow
def test_enable_log_requests_logs_each_request_cut_to_max_log_len(serve_model: Path, start_server: Any) -> None:
    """vLLM's --enable-log-requests: one INFO line per request received, naming its id,
    prompt, parameters and prompt token ids, the prompt and the ids cut to --max-log-len."""
    server = start_server(_server_args(serve_model, "--enable-log-requests", "--max-log-len", "3", tp=1))
    prompt = "Hello there, how are you today?"
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0, "request_id": "logme"}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    deadline = time.monotonic() + 10
    while "Received request cmpl-logme" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(x for x in server.log().splitlines() if "Received request cmpl-logme" in x)
    assert "params: SamplingParams(" in line and "max_tokens=2" in line, line
    shown = line.split("prompt_token_ids: ")[1].split("]")[0] + "]"
    assert len(json.loads(shown)) == 3, line
    text = line.split("prompt: ")[1].split(", params: ")[0]
    assert len(ast.literal_eval(text)) <= 3, line


def test_help() -> None:
    out = subprocess.run([sys.executable, "-m", "engine.serve", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--tp", "--host", "--port", "--dtype", "--max-model-len", "--max-num-seqs", "--kv-cache-memory",
                 "--api-key", "--device", "--load-format", "--seed", "--no-cpu-prepack-weights", "MODEL"):
        assert flag in out.stdout or flag.lower() in out.stdout


@pytest.mark.slow
def test_api_key_then_sigterm_stops_cleanly(serve_model: Path, start_server: Any) -> None:
    # (also the plain-sgemm path: this server runs without packed CPU weights)
    server = start_server(_server_args(serve_model, "--api-key", "s3cret", "--shutdown-timeout", "5",
                                       "--no-cpu-prepack-weights"))
    url = f"{server.url}/v1"
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.get(f"{url}/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # not under /v1
    good = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0, timeout=120)
    assert good.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1

    # An in-flight request while SIGTERM arrives: it ends (done or cut off), it never hangs.
    outcome: list[Any] = []

    def in_flight() -> None:
        try:
            outcome.append(good.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=200,
                                                   extra_body={"ignore_eos": True}))
        except Exception as e:  # noqa: BLE001
            outcome.append(e)

    thread = threading.Thread(target=in_flight)
    thread.start()
    time.sleep(0.3)
    children = _descendants(server.pid)
    assert children, "a TP=2 server has worker processes"
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0, server.log()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"left running: {alive}"
    thread.join(timeout=60)
    assert not thread.is_alive() and outcome
    assert "Serving tiny-serve on http://127.0.0.1:" in server.log()


@pytest.mark.slow
def test_worker_death_turns_health_503_and_exits_nonzero(serve_model: Path, start_server: Any) -> None:
    server = start_server(_server_args(serve_model, "--max-worker-restarts", "0"))  # no self-healing
    children = _descendants(server.pid)
    # Workers are the leaves (forkserver children); the resource tracker is a leaf too.
    workers = [p for p in children if not p.children() and "resource_tracker" not in " ".join(p.cmdline())]
    assert len(workers) == 2, [(p.pid, p.cmdline()) for p in children]
    stream_result: list[Any] = []

    def long_stream() -> None:
        body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 240, "ignore_eos": True, "stream": True}
        try:
            stream_result.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).text)
        except httpx.TransportError as e:
            stream_result.append(e)

    thread = threading.Thread(target=long_stream)
    thread.start()
    time.sleep(0.5)
    workers[0].kill()
    deadline = time.monotonic() + 20
    saw_503_or_gone = False
    while time.monotonic() < deadline and not saw_503_or_gone:
        try:
            saw_503_or_gone = httpx.get(f"{server.url}/health", timeout=2).status_code == 503
        except httpx.TransportError:
            saw_503_or_gone = True
        time.sleep(0.1)
    assert saw_503_or_gone, server.log()
    assert server.wait(timeout=60) != 0
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"left running: {alive}"
    thread.join(timeout=60)
    assert not thread.is_alive() and stream_result
    if isinstance(stream_result[0], str) and "[DONE]" in stream_result[0]:
        # It either finished before the kill or reports the failure in the stream.
        payloads = _sse_payloads(stream_result[0])
        assert "error" in payloads[-1] or payloads[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_a_dead_worker_is_replaced_and_the_server_goes_on(serve_model: Path, start_server: Any) -> None:
    server = start_server(_server_args(serve_model, "--max-worker-restarts", "1"))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    before = client.completions.create(**kwargs).choices[0].text
    workers = [p for p in _descendants(server.pid)
               if not p.children() and "resource_tracker" not in " ".join(p.cmdline())]
    assert len(workers) == 2, workers
    workers[0].kill()
    deadline = time.monotonic() + 60
    while "worker group restarted" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "worker group restarted" in server.log(), server.log()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert client.completions.create(**kwargs).choices[0].text == before
    assert server.proc.poll() is None
    restarts = [line for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                if line.startswith("tp_runtime:worker_restarts_total{")]
    assert len(restarts) == 1 and restarts[0].endswith(" 1.0"), restarts


@pytest.mark.slow
def test_no_model_serves_the_demo_model(start_server: Any, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    server = start_server(["--device", "cpu", "--no-access-log"], env={"TP_RUNTIME_CACHE": str(cache)})
    assert (cache / "demo-model" / "config.json").is_file()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    [model] = client.models.list().data
    completion = client.completions.create(model=model.id, prompt="Hello", max_tokens=4,
                                           extra_body={"ignore_eos": True})
    assert model.id == "tp-runtime-demo" and completion.usage.completion_tokens == 4
    server.proc.send_signal(signal.SIGINT)
    assert server.wait(timeout=60) == 0, server.log()
