"""Tool calling, reasoning and cached-token usage through `python -m engine.serve`
(vLLM 0.32's behaviour), end to end on a tiny random-weight model.

A random model's text is junk, so "auto" parsing is tested on fixed texts
(tests/test_tool_parsers.py); here "required" and named functions must come out as
calls that parse and validate against their schemas (the engine's grammar makes
them), streamed and whole alike; tool results and earlier calls reach a chat template
that renders tools; the thinking goes to `reasoning`; bad tools are 400s naming the
field while the server goes on; a repeated prompt reports its prefix-cache hits.

One server serves the module: hermes tool parser without --enable-auto-tool-choice
(so "auto" is the 400 vLLM gives), the qwen3 reasoning parser, prompt-token details,
and grammars without optional whitespace.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from tokenizers import Tokenizer

from tests.test_serve import MODEL_NAME, ServerProcess, _server_args

pytestmark = pytest.mark.slow

# Renders tools, earlier calls (their arguments as a dict) and tool results, and
# Qwen3's closed thinking block when enable_thinking is false.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}result {{ m.tool_call_id }}: {{ m.content }}\n"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }} city={{ c.function.arguments.city }}"
    "\n{% endfor %}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
DAYS = {"type": "object", "properties": {"days": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY,
                                           "strict": True}},
         {"type": "function", "function": {"name": "forecast", "parameters": DAYS}}]
SCHEMAS = {"get_weather": CITY, "forecast": DAYS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(serve_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("tools_log")
    template = logs / "tool_template.jinja"
    template.write_text(TOOL_TEMPLATE)
    # Compact JSON: a random model would otherwise fill the grammar's optional whitespace up to max_tokens.
    proc = ServerProcess(_server_args(serve_model, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                                      "--enable-prompt-tokens-details", "--chat-template", str(template),
                                      "--structured-outputs-config", '{"disable_any_whitespace": true}', tp=1),
                         logs / "server.log").start()
    yield proc
    proc.stop()


def _chat(server: ServerProcess, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions",
                      json={"model": MODEL_NAME, "messages": MESSAGES, **body}, timeout=300)


def _stream(server: ServerProcess, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", f"{server.url}/v1/{route}", json={"model": MODEL_NAME, "stream": True, **body},
                      timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def _joined(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed choice 0 put back together: reasoning, content, calls, finish reason."""
    joined: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish_reason": None}
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            joined["reasoning"] += delta.get("reasoning") or ""
            joined["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                if call["index"] not in joined["calls"]:
                    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
                    joined["calls"][call["index"]] = {"name": call["function"]["name"], "arguments": ""}
                joined["calls"][call["index"]]["arguments"] += call["function"].get("arguments") or ""
            joined["finish_reason"] = choice["finish_reason"] or joined["finish_reason"]
    joined["calls"] = [joined["calls"][i] for i in sorted(joined["calls"])]
    return joined


def _check_calls(calls: list[dict[str, Any]]) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_required_tool_choice_makes_calls_that_validate(server: ServerProcess, sampling: dict[str, Any]) -> None:
    body = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 120, **sampling}
    whole = _chat(server, **body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = [c["function"] for c in choice["message"]["tool_calls"]]
    _check_calls(calls)
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
               for c in choice["message"]["tool_calls"])
    assert choice["message"]["content"] is None and choice["message"]["reasoning"] is None
    streamed = _joined(_stream(server, "chat/completions", {"messages": MESSAGES, **body}))
    assert streamed["calls"] == calls and streamed["finish_reason"] == "tool_calls"


def test_one_call_only_when_parallel_tool_calls_is_false(server: ServerProcess) -> None:
    response = _chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                     temperature=1.0, seed=3)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["message"]["tool_calls"]) == 1


def test_a_named_function_is_called_with_valid_arguments(server: ServerProcess) -> None:
    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "forecast"}},
            "max_tokens": 80, "temperature": 0}
    response = _chat(server, **body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # OpenAI's answer for a named function
    calls = [c["function"] for c in choice["message"]["tool_calls"]]
    assert [c["name"] for c in calls] == ["forecast"]
    _check_calls(calls)
    streamed = _joined(_stream(server, "chat/completions", {"messages": MESSAGES, **body}))
    assert streamed["calls"] == calls


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "none"},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tool_choice": "none"},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "not_a_tool"}}}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" needs --enable-auto-tool-choice
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tools_are_400s_naming_the_field_and_the_server_goes_on(server: ServerProcess, body: dict[str, Any],
                                                                    param: str) -> None:
    response = _chat(server, max_tokens=2, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert _chat(server, max_tokens=2).status_code == 200


def test_tool_results_and_calls_reach_the_template(server: ServerProcess, serve_model: Path) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = _chat(server, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2,
                     return_token_ids=True, chat_template_kwargs={"enable_thinking": False})
    assert response.status_code == 200, response.text
    ids = response.json()["prompt_token_ids"]
    rendered = Tokenizer.from_file(str(serve_model / "tokenizer.json")).decode(ids, skip_special_tokens=False)
    assert rendered == ("<s>tools: get_weather forecast\nuser: What is the weather in Paris?\n"
                        "call get_weather city=Paris\nresult call_1: sunny\nassistant:<think>\n\n</think>\n\n")


def test_tokenize_renders_tools_and_tool_messages_as_the_chat_route_does(server: ServerProcess) -> None:
    """/tokenize takes the chat route's messages (calls, results) and `tools`: the same
    prompt ids; a malformed tool is a 400 naming it there too."""
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    chat = _chat(server, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=1, return_token_ids=True,
                 **kwargs)
    assert chat.status_code == 200, chat.text
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "messages": messages, "tools": TOOLS,
                                                            **kwargs}, timeout=60)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == chat.json()["prompt_token_ids"]
    without = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "messages": messages, **kwargs},
                         timeout=60).json()["tokens"]
    assert len(without) < len(tokenized.json()["tokens"])  # the template's tools line
    bad = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                     "tools": [{"type": "function", "function": {}}]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].function.name", bad.text


def test_thinking_goes_to_reasoning_streamed_and_whole(server: ServerProcess) -> None:
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = _chat(server, **body).json()["choices"][0]["message"]
    # No </think> from a random model: all of it is thinking (cut off by max_tokens).
    assert whole["reasoning"] and whole["content"] is None
    streamed = _joined(_stream(server, "chat/completions", {"messages": MESSAGES, **body}))
    assert (streamed["reasoning"], streamed["content"] or None) == (whole["reasoning"], whole["content"])
    hidden = _chat(server, include_reasoning=False, **body).json()["choices"][0]["message"]
    assert hidden["reasoning"] is None and hidden["content"] is None
    off = _chat(server, chat_template_kwargs={"enable_thinking": False}, **body).json()["choices"][0]["message"]
    assert off["reasoning"] is None and off["content"]
    history = [*MESSAGES, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Looked it up."},
               {"role": "user", "content": "Thanks"}]
    assert _chat(server, messages=history, **body).status_code == 200


def test_a_repeated_prompt_reports_its_cached_tokens(server: ServerProcess) -> None:
    prompt = "Once upon a time there was a small village near the river, and the people who lived there " * 2

    def usage(**body: Any) -> dict[str, Any]:
        response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": prompt,
                                                                    "max_tokens": 2, **body}, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    first = usage()
    assert first["prompt_tokens"] > 32 and first["prompt_tokens_details"] is None  # fresh: vLLM leaves it out
    again = usage()
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["prompt_tokens"] and cached % 16 == 0  # whole blocks of 16
    events = _stream(server, "completions", {"prompt": prompt, "max_tokens": 2,
                                             "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    chat = [{"role": "user", "content": prompt}]
    assert _chat(server, messages=chat, max_tokens=2).json()["usage"]["prompt_tokens_details"] is None
    assert _chat(server, messages=chat, max_tokens=2).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
