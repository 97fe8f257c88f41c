"""Every request field vLLM knows is honoured or refused by `engine.serve`, never
silently dropped: stop strings (streamed and whole), n and best_of, lists of prompts,
echo and prompt logprobs (log-likelihood scoring), penalties and the other sampling
options, explicit nulls, unknown fields, and the model's generation config.

One TP=1 server (a real `python -m engine.serve` process on loopback) runs the checks;
a second one checks `--generation-config PATH`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from engine.tiny_model import EOS_ID
from tests.test_serve import MODEL_NAME, ServerProcess, _server_args

PROMPT = "Hello, my name is"
MESSAGES = [{"role": "user", "content": "Tell me a story"}]

# vLLM 0.32's request fields (its CompletionRequest and ChatCompletionRequest), plus the
# guided_* fields and best_of of earlier versions that clients still send.
VLLM_COMPLETION_FIELDS = """model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed
stop stream stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty watermarking
length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs
logprob_token_ids bad_words prompt_embeds add_special_tokens response_format structured_outputs priority request_id
session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets mm_payload
return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs repetition_detection
thinking_token_budget stream_interval best_of guided_json guided_regex guided_choice guided_grammar""".split()
VLLM_CHAT_FIELDS = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens
n presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice
reasoning_effort thinking_token_budget include_reasoning parallel_tool_calls user use_beam_search top_k min_p
repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side prompt_logprobs
logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt continue_final_message add_special_tokens
documents chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs structured_outputs priority
request_id session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets
return_prompt_text mm_payload return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs
repetition_detection stream_interval guided_json guided_regex guided_choice guided_grammar""".split()

# Each refused field with a value that asks for what we cannot do.
REFUSED: dict[str, Any] = {
    "use_beam_search": True, "length_penalty": 0.5, "guided_json": {"type": "object"},
    "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": "root ::= 'a'", "guided_whitespace_pattern": " ",
    "guided_decoding_backend": "xgrammar", "logits_processors": ["x"], "prompt_embeds": "AAAA", "mm_payload": {"a": 1},
    "return_mm_kwargs": True, "kv_transfer_params": {"a": 1}, "ec_transfer_params": {"a": 1}, "session_id": "s",
    "watermarking": True, "logprob_token_ids": [1], "vllm_xargs": {"a": 1}, "repetition_detection": {"a": 1},
    "thinking_token_budget": 10, "routed_experts_prompt_start": 3, "return_token_offsets": True,
    "stream_interval": 4, "spaces_between_special_tokens": False, "priority": 1,
    "stream_options": {"include_usage": True},
}
REFUSED_COMPLETION = {**REFUSED, "suffix": "the end"}
# tool_choice "auto" without tools (and without --enable-auto-tool-choice) is a 400 naming it.
REFUSED_CHAT = {**REFUSED, "tool_choice": "auto", "reasoning_effort": "low", "documents": [{"a": 1}],
                "media_io_kwargs": {"a": 1}, "mm_processor_kwargs": {"a": 1}, "return_prompt_text": True,
                "chat_template": "{{ messages }}"}
# Each honoured field, and the test that shows its effect.
HONOURED = {
    "model": "test_unknown_fields_are_ignored_and_nulls_mean_default",
    "prompt": "test_a_list_of_prompts_and_n_samples",
    "messages": "test_chat_echo_continue_final_message_and_template_kwargs",
    "echo": "test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt",
    "frequency_penalty": "test_sampling_fields_change_the_output",
    "presence_penalty": "test_sampling_fields_change_the_output",
    "repetition_penalty": "test_sampling_fields_change_the_output",
    "logit_bias": "test_sampling_fields_change_the_output",
    "min_tokens": "test_sampling_fields_change_the_output",
    "allowed_token_ids": "test_sampling_fields_change_the_output",
    "bad_words": "test_sampling_fields_change_the_output",
    "min_p": "test_sampling_fields_change_the_output",
    "top_k": "test_sampling_fields_change_the_output",
    "top_p": "test_sampling_fields_change_the_output",
    "temperature": "test_sampling_fields_change_the_output",
    "seed": "test_a_list_of_prompts_and_n_samples",
    "ignore_eos": "test_sampling_fields_change_the_output",
    "stop_token_ids": "test_sampling_fields_change_the_output",
    "logprobs": "test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt",
    "top_logprobs": "test_chat_echo_continue_final_message_and_template_kwargs",
    "prompt_logprobs": "test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt",
    "max_tokens": "test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt",
    "max_completion_tokens": "test_chat_echo_continue_final_message_and_template_kwargs",
    "n": "test_a_list_of_prompts_and_n_samples",
    "best_of": "test_a_list_of_prompts_and_n_samples",
    "stop": "test_stop_strings_stream_and_whole_agree",
    "include_stop_str_in_output": "test_stop_strings_stream_and_whole_agree",
    "stream": "test_stop_strings_stream_and_whole_agree",
    "stream_options": "test_stream_usage_options",
    "skip_special_tokens": "test_text_fields",
    "add_special_tokens": "test_text_fields",
    "truncate_prompt_tokens": "test_text_fields",
    "truncation_side": "test_text_fields",
    "request_id": "test_ids_token_ids_and_salts",
    "cache_salt": "test_ids_token_ids_and_salts",
    "return_token_ids": "test_ids_token_ids_and_salts",
    "return_tokens_as_token_ids": "test_ids_token_ids_and_salts",
    "user": "test_unknown_fields_are_ignored_and_nulls_mean_default",  # the caller's own id, as in OpenAI
    "response_format": "tests/test_structured_outputs_serve.py",
    "structured_outputs": "tests/test_structured_outputs_serve.py",
    "add_generation_prompt": "test_chat_echo_continue_final_message_and_template_kwargs",
    "continue_final_message": "test_chat_echo_continue_final_message_and_template_kwargs",
    "chat_template_kwargs": "test_chat_echo_continue_final_message_and_template_kwargs",
    "tools": "tests/test_serve_tools.py::test_required_tool_choice_makes_calls_that_validate",
    "tool_choice": "tests/test_serve_tools.py::test_a_named_function_is_called_with_valid_arguments",
    "parallel_tool_calls": "tests/test_serve_tools.py::test_one_call_only_when_parallel_tool_calls_is_false",
    "include_reasoning": "tests/test_serve_tools.py::test_thinking_goes_to_reasoning_streamed_and_whole",
    "priority": "test_unknown_fields_are_ignored_and_nulls_mean_default",  # 0 only
    "spaces_between_special_tokens": "test_unknown_fields_are_ignored_and_nulls_mean_default",  # true only
    "stream_interval": "test_unknown_fields_are_ignored_and_nulls_mean_default",  # 1 only
}


@pytest.fixture(scope="module")
def server(serve_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("fields_log")
    proc = ServerProcess(_server_args(serve_model, tp=1), logs / "server.log").start()
    yield proc
    proc.stop()


def _post(server: ServerProcess, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL_NAME, **body}, timeout=120)


def _complete(server: ServerProcess, **body: Any) -> dict[str, Any]:
    response = _post(server, "completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                             "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _stream(server: ServerProcess, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", f"{server.url}/v1/{route}", json={"model": MODEL_NAME, "stream": True, **body},
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def _tokenize(server: ServerProcess, text: str) -> list[dict[str, Any]]:
    """Each token of `text` with its own text (through logprobs of an echoed prompt)."""
    body = _complete(server, prompt=text, max_tokens=0, echo=True, logprobs=0, add_special_tokens=False)
    return [{"text": t} for t in body["choices"][0]["logprobs"]["tokens"]]


def _text(server: ServerProcess, **body: Any) -> str:
    return _complete(server, **body)["choices"][0]["text"]


def test_every_vllm_field_is_declared_and_covered() -> None:
    for model, vllm_fields, refused in ((CompletionRequest, VLLM_COMPLETION_FIELDS, REFUSED_COMPLETION),
                                        (ChatCompletionRequest, VLLM_CHAT_FIELDS, REFUSED_CHAT)):
        ours = set(model.model_fields)
        assert set(vllm_fields) <= ours, set(vllm_fields) - ours  # none falls through to "ignored"
        covered = set(HONOURED) | set(refused)
        assert ours <= covered, ours - covered


@pytest.mark.parametrize("route, field", [("completions", f) for f in REFUSED_COMPLETION]
                         + [("chat/completions", f) for f in REFUSED_CHAT])
@pytest.mark.slow
def test_refused_fields_are_a_400_naming_them(server: ServerProcess, route: str, field: str) -> None:
    refused = REFUSED_COMPLETION if route == "completions" else REFUSED_CHAT
    body = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    response = _post(server, route, {**body, "max_tokens": 2, field: refused[field]})
    assert response.status_code == 400, (field, response.text)
    assert response.json()["error"]["param"] == field, response.text


@pytest.mark.slow
def test_unknown_fields_are_ignored_and_nulls_mean_default(server: ServerProcess) -> None:
    base = _text(server)
    nulls = {"stream": None, "n": None, "stop": None, "logprobs": None, "seed": None, "stream_options": None,
             "logit_bias": None, "presence_penalty": None, "top_k": None, "best_of": None, "suffix": None}
    assert _text(server, **nulls) == base
    assert _text(server, user="someone", response_format={"type": "text"}, priority=0, stream_interval=1,
                 spaces_between_special_tokens=True, not_a_vllm_field=123) == base
    assert "not_a_vllm_field" in server.log() and "present in the request but ignored" in server.log()
    chat = _post(server, "chat/completions", {"messages": MESSAGES, "max_tokens": 3, "tool_choice": "none",
                                              "include_reasoning": True, "n": None, "temperature": None})
    assert chat.status_code == 200, chat.text


@pytest.mark.slow
def test_stop_strings_stream_and_whole_agree(server: ServerProcess) -> None:
    full = _text(server, max_tokens=24)
    stop = full[7:10]
    assert stop and stop in full
    whole = _complete(server, max_tokens=24, stop=[stop])["choices"][0]
    assert whole["text"] == full[:full.index(stop)] and whole["finish_reason"] == "stop"
    assert whole["stop_reason"] == stop
    events = _stream(server, "completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                             "ignore_eos": True, "stop": stop})
    pieces = [e["choices"][0]["text"] for e in events if e["choices"]]
    streamed = ""
    for piece in pieces:
        streamed += piece
        assert stop not in streamed and full.startswith(streamed)
    assert streamed == whole["text"] and events[-1]["choices"][0]["finish_reason"] == "stop"
    kept = _text(server, max_tokens=24, stop=stop, include_stop_str_in_output=True)
    assert kept == full[:full.index(stop) + len(stop)]
    chat_full = _post(server, "chat/completions", {"messages": MESSAGES, "max_tokens": 20, "temperature": 0,
                                                   "ignore_eos": True}).json()["choices"][0]["message"]["content"]
    chat_stop = chat_full[5:8]
    chat = _post(server, "chat/completions", {"messages": MESSAGES, "max_tokens": 20, "temperature": 0,
                                              "ignore_eos": True, "stop": chat_stop}).json()["choices"][0]
    assert chat["message"]["content"] == chat_full[:chat_full.index(chat_stop)]
    chat_events = _stream(server, "chat/completions", {"messages": MESSAGES, "max_tokens": 20, "temperature": 0,
                                                       "ignore_eos": True, "stop": chat_stop})
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in chat_events if e["choices"])
    assert content == chat["message"]["content"]


@pytest.mark.slow
def test_a_list_of_prompts_and_n_samples(server: ServerProcess) -> None:
    prompts = [PROMPT, "The capital of France"]
    body = {"prompt": prompts, "n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 8}
    first = _complete(server, **body)
    again = _complete(server, **body)
    texts = [c["text"] for c in sorted(first["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in first["choices"]] == list(range(6))
    assert texts == [c["text"] for c in sorted(again["choices"], key=lambda c: c["index"])]
    assert len(set(texts[:3])) == 3 and len(set(texts[3:])) == 3
    # Prompt i's samples are what the prompt alone gives.
    alone = _complete(server, **{**body, "prompt": prompts[1]})
    assert [c["text"] for c in alone["choices"]] == texts[3:]
    usage = first["usage"]
    assert usage["completion_tokens"] == 6 * 8
    streamed: dict[int, str] = {}
    for event in _stream(server, "completions", body):
        for choice in event["choices"]:
            streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
    assert [streamed[i] for i in range(6)] == texts
    best = _complete(server, prompt=PROMPT, n=1, best_of=3, seed=7, temperature=1.0, max_tokens=8)
    assert len(best["choices"]) == 1 and best["choices"][0]["text"] in texts[:3]
    chat = _post(server, "chat/completions", {"messages": MESSAGES, "n": 2, "seed": 1, "max_tokens": 6}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt(server: ServerProcess) -> None:
    """lm-evaluation-harness's log-likelihood request."""
    scored = _complete(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)["choices"][0]
    assert scored["text"] == PROMPT and scored["finish_reason"] == "length"
    logprobs = scored["logprobs"]
    num = len(logprobs["tokens"])
    assert num >= 4 and logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in logprobs["token_logprobs"][1:])
    assert all(len(top) >= 1 for top in logprobs["top_logprobs"][1:])
    assert "".join(logprobs["tokens"]).replace("<s>", "") == PROMPT
    # The same numbers as vLLM's prompt_logprobs field.
    vllm_style = _complete(server, prompt=PROMPT, max_tokens=1, prompt_logprobs=0)["choices"][0]["prompt_logprobs"]
    assert vllm_style[0] is None and len(vllm_style) == num
    for i in range(1, num):
        (entry,) = vllm_style[i].values()
        assert abs(entry["logprob"] - logprobs["token_logprobs"][i]) < 1e-5 and entry["rank"] >= 1
    # Echo with generated tokens: the prompt's tokens, then the completion's.
    echoed = _complete(server, prompt=PROMPT, max_tokens=3, echo=True, logprobs=0)["choices"][0]
    assert echoed["text"].startswith(PROMPT) and len(echoed["logprobs"]["tokens"]) == num + 3
    assert echoed["logprobs"]["text_offset"][num] == len(PROMPT)


@pytest.mark.slow
def test_sampling_fields_change_the_output(server: ServerProcess) -> None:
    base = _complete(server, max_tokens=16, return_token_ids=True)["choices"][0]
    ids = base["token_ids"]

    def tokens(**body: Any) -> list[int]:
        return _complete(server, max_tokens=16, return_token_ids=True, **body)["choices"][0]["token_ids"]

    words = [t["text"].strip() for t in _tokenize(server, base["text"])]
    word = next(w for w in words if w.isalpha() and len(w) >= 2)
    for field, value in (("repetition_penalty", 2.0), ("frequency_penalty", 2.0), ("presence_penalty", 2.0),
                         ("logit_bias", {str(ids[0]): -100}), ("bad_words", [word]),
                         ("allowed_token_ids", [7, 8, 9])):
        assert tokens(**{field: value}) != ids, field
    assert set(tokens(allowed_token_ids=[7, 8, 9])) <= {7, 8, 9}
    eos = {str(EOS_ID): 100}
    assert tokens(logit_bias=eos, ignore_eos=False) == [EOS_ID]
    assert tokens(logit_bias=eos, ignore_eos=False, min_tokens=5)[5] == EOS_ID
    assert len(tokens(stop_token_ids=[ids[3]], ignore_eos=False)) == ids.index(ids[3]) + 1
    sampled = dict(temperature=1.0, seed=3)
    assert tokens(**sampled, min_p=0.9999) == ids  # only the likeliest survives
    assert tokens(**sampled, top_k=1) == ids and tokens(**sampled, top_p=1e-6) == ids
    assert tokens(**sampled) != ids


def test_text_fields(server: ServerProcess) -> None:
    eos = {str(EOS_ID): 100}
    assert _text(server, max_tokens=2, logit_bias=eos) == ""
    assert _text(server, max_tokens=2, logit_bias=eos, skip_special_tokens=False) == "</s></s>"
    with_bos = _complete(server, max_tokens=1, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    without = _complete(server, max_tokens=1, return_token_ids=True, add_special_tokens=False)
    assert without["choices"][0]["prompt_token_ids"] == with_bos[1:]
    cut = _complete(server, max_tokens=1, truncate_prompt_tokens=3, return_token_ids=True)
    assert cut["choices"][0]["prompt_token_ids"] == with_bos[-3:] and cut["usage"]["prompt_tokens"] == 3
    right = _complete(server, max_tokens=1, truncate_prompt_tokens=3, truncation_side="right",
                      return_token_ids=True)
    assert right["choices"][0]["prompt_token_ids"] == with_bos[:3]


def test_ids_token_ids_and_salts(server: ServerProcess) -> None:
    body = _complete(server, request_id="my-id-1", return_token_ids=True, logprobs=0,
                     return_tokens_as_token_ids=True)
    assert body["id"] == "cmpl-my-id-1"
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert _text(server, cache_salt="tenant-a") == _text(server, cache_salt="tenant-b") == _text(server)


def test_stream_usage_options(server: ServerProcess) -> None:
    events = _stream(server, "completions", {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True,
                                             "stream_options": {"include_usage": True,
                                                                "continuous_usage_stats": True}})
    assert all(e["usage"] is not None for e in events)
    assert [e["usage"]["completion_tokens"] for e in events if e["choices"]][-1] == 4
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4


def test_chat_echo_continue_final_message_and_template_kwargs(server: ServerProcess) -> None:
    start = "Once upon a time"
    messages = [*MESSAGES, {"role": "assistant", "content": start}]
    body = {"messages": messages, "max_completion_tokens": 5, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True}
    cont = _post(server, "chat/completions", body).json()
    echo = _post(server, "chat/completions", {**body, "echo": True}).json()
    assert echo["choices"][0]["message"]["content"] == start + cont["choices"][0]["message"]["content"]
    assert cont["usage"]["completion_tokens"] == 5
    # continue_final_message is the prompt ending right after the assistant's text.
    tokenize = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": "x", "max_tokens": 1}).status_code
    assert tokenize == 200
    both = _post(server, "chat/completions", {**body, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    top = _post(server, "chat/completions", {"messages": MESSAGES, "max_tokens": 2, "logprobs": True,
                                             "top_logprobs": 3}).json()
    assert all(len(t["top_logprobs"]) == 3 for t in top["choices"][0]["logprobs"]["content"])
    kwargs = _post(server, "chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                                "chat_template_kwargs": {"unused_variable": True}})
    assert kwargs.status_code == 200


@pytest.mark.slow
def test_generation_config_path_sets_defaults(serve_model: Path, tmp_path: Path) -> None:
    config_dir = tmp_path / "genconfig"
    config_dir.mkdir()
    (config_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    proc = ServerProcess(_server_args(serve_model, "--generation-config", str(config_dir), tp=1),
                         tmp_path / "server.log").start()
    try:
        body = {"model": MODEL_NAME, "prompt": PROMPT, "ignore_eos": True}
        first = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=60).json()
        second = httpx.post(f"{proc.url}/v1/completions", json={**body, "seed": 99}, timeout=60).json()
        assert first["usage"]["completion_tokens"] == 5  # max_new_tokens is the default max_tokens
        assert first["choices"][0]["text"] == second["choices"][0]["text"]  # temperature 0: greedy
        explicit = httpx.post(f"{proc.url}/v1/completions", json={**body, "temperature": 1.0, "seed": 99,
                                                                   "max_tokens": 5}, timeout=60).json()
        assert explicit["choices"][0]["text"] != first["choices"][0]["text"]
        assert "overridden by" in proc.log()
    finally:
        proc.stop()


@pytest.mark.slow
def test_bad_values_name_their_field(server: ServerProcess) -> None:
    for field, value in (("stop_token_ids", [10**6]), ("allowed_token_ids", [10**6]), ("logit_bias", {"1000000": 1}),
                         ("logit_bias", {"x": 1}), ("n", 10**6), ("best_of", 10**6), ("min_tokens", 99)):
        response = _post(server, "completions", {"prompt": PROMPT, "max_tokens": 4, field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, response.text)
    chat = _post(server, "chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                              "chat_template_kwargs": {"add_generation_prompt": False}})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "chat_template_kwargs", chat.text
