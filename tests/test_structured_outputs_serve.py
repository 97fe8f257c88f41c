"""Structured outputs over HTTP (`engine.serve`): `response_format` json_schema /
json_object and vLLM 0.32's `structured_outputs` are honoured in completions and chat
completions (whole and streamed, with n); a constraint that does not compile, a schema
feature the backend cannot enforce and the removed ``guided_*`` fields are a 400 naming
the field, and the server goes on serving. One TP=1 server with a random tiny llama,
whose unconstrained output is junk."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_serve import MODEL_NAME, ServerProcess, _server_args

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
                                           "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]}


@pytest.fixture(scope="module")
def server(serve_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("structured_log") / "server.log"
    # No whitespace between JSON tokens, engine-wide: else a random model, greedy, may pad for ever.
    args = _server_args(serve_model, "--structured-outputs-config",
                        '{"backend": "xgrammar", "disable_any_whitespace": true}', tp=1)
    proc = ServerProcess(args, log).start()
    yield proc
    proc.stop()


def post(server: ServerProcess, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL_NAME, **body}, timeout=120)


def complete(server: ServerProcess, **body: Any) -> dict[str, Any]:
    response = post(server, "completions", {"prompt": "The weather today", "max_tokens": 40, **body})
    assert response.status_code == 200, response.text
    return response.json()


def chat(server: ServerProcess, **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "What is the weather like?"}]
    response = post(server, "chat/completions", {"messages": messages, "max_tokens": 40, **body})
    assert response.status_code == 200, response.text
    return response.json()


def check_schema(text: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_follow_structured_outputs(server):
    body = complete(server, n=3, temperature=1.0, seed=1, structured_outputs={"json": SCHEMA})
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop", choice
        check_schema(choice["text"])
    regex = complete(server, temperature=1.0, structured_outputs={"regex": r"\d{3}-[a-z]{2}"})
    assert re.fullmatch(r"\d{3}-[a-z]{2}", regex["choices"][0]["text"])
    choice = complete(server, temperature=0.0, structured_outputs={"choice": ["sunny", "rainy"]})
    assert choice["choices"][0]["text"] in ("sunny", "rainy")


def test_chat_response_format_json_schema_and_json_object(server):
    for temperature in (0.0, 1.0):
        body = chat(server, temperature=temperature, response_format={
            "type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}})
        assert body["choices"][0]["finish_reason"] == "stop"
        check_schema(body["choices"][0]["message"]["content"])
    body = chat(server, temperature=1.0, seed=2, max_tokens=24, response_format={"type": "json_object"})
    content, reason = body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]
    assert content.startswith("{") and (reason == "length" or isinstance(json.loads(content, strict=False), dict))


def test_streamed_constrained_text_reassembles(server):
    pieces, reasons = [], []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": "Pick one", "max_tokens": 20, "stream": True, "temperature": 1.0,
            "structured_outputs": {"choice": ["alpha beta", "gamma"]}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[len("data: "):])["choices"][0]
                pieces.append(choice["text"])
                reasons.append(choice["finish_reason"])
    assert "".join(pieces) in ("alpha beta", "gamma") and reasons[-1] == "stop"


def test_max_tokens_reached_is_length_with_what_was_generated(server):
    body = complete(server, max_tokens=2, temperature=0.0, structured_outputs={"json": SCHEMA})
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"].startswith("{") and body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("route, field, value, param", [
    ("completions", "structured_outputs", {"json": {"type": "nonsense"}}, "structured_outputs.json"),
    ("completions", "structured_outputs", {"regex": "(unclosed"}, "structured_outputs.regex"),
    ("completions", "structured_outputs", {"grammar": "root ::= nowhere"}, "structured_outputs.grammar"),
    ("completions", "structured_outputs", {"json": {"type": "array", "uniqueItems": True}},
     "structured_outputs.json"),
    ("completions", "structured_outputs", {"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ("chat/completions", "response_format", {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wrong"}}}}},
     "response_format.json_schema"),
    ("chat/completions", "response_format", {"type": "json_schema", "json_schema": {"name": "x"}},
     "response_format.json_schema"),
    ("chat/completions", "response_format", {"type": "xml"}, "response_format.type"),
    ("completions", "guided_json", {"type": "object"}, "guided_json"),
    ("chat/completions", "guided_regex", "a+", "guided_regex"),
])
def test_bad_constraints_are_a_400_naming_the_field_and_serving_goes_on(server, route, field, value, param):
    body = {"prompt": "Hi"} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    response = post(server, route, {**body, "max_tokens": 4, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if field.startswith("guided_"):
        assert "structured_outputs" in error["message"] and "0.32" in error["message"]
    # ignore_eos: sampled at temperature 1 from 512 tokens, EOS ends ~0.4% of 2-token answers.
    assert complete(server, max_tokens=2, ignore_eos=True)["choices"][0]["finish_reason"] == "length"
