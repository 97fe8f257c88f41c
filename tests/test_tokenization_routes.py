"""POST /tokenize and /detokenize (vLLM's shapes), and the --tokenizer and
--chat-template flags they make visible, against one TP=1 `python -m engine.serve`.

The served model directory has no tokenizer of its own: `--tokenizer` names one, so
a text prompt works only if the flag does. `--chat-template` is an inline template
unlike the tokenizer's, so every chat rendering (here and in /v1/chat/completions)
shows which template was used.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.test_serve import MAX_MODEL_LEN, ServerProcess, tokenizer  # noqa: F401 - a fixture

NAME = "tiny-tok"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}{{ suffix | default('') }}"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json")


def _render(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
    return text + ("<assistant>" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def tok_server(serve_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:  # noqa: F811
    root = tmp_path_factory.mktemp("tokenization")
    model = root / "model-without-tokenizer"
    shutil.copytree(serve_model, model, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    assert not (model / "tokenizer.json").exists()
    args = [str(model), "--tokenizer", str(serve_model), "--chat-template", TEMPLATE, "--device", "cpu",
            "--dtype", "float32", "--kv-cache-memory-bytes", "16MiB", "--max-model-len", str(MAX_MODEL_LEN),
            "--served-model-name", NAME, "other-name", "--no-access-log", "--disable-log-stats"]
    proc = ServerProcess(args, root / "server.log").start()
    yield proc
    proc.stop()


def _post(server: ServerProcess, route: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/{route}", json=body, timeout=60)


@pytest.mark.slow
def test_tokenize_a_prompt(tok_server: ServerProcess, tokenizer: Tokenizer) -> None:  # noqa: F811
    expected = tokenizer.encode("Hello world").ids  # with BOS, as /v1/completions encodes text
    body = _post(tok_server, "tokenize", {"model": NAME, "prompt": "Hello world"}).json()
    assert body == {"count": len(expected), "max_model_len": MAX_MODEL_LEN, "tokens": expected, "token_strs": None}
    bare = _post(tok_server, "tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False).ids
    assert bare["tokens"] == expected[1:]
    strs = _post(tok_server, "tokenize", {"model": "other-name", "prompt": "Hello world",
                                          "return_token_strs": True}).json()
    assert strs["token_strs"] == [tokenizer.id_to_token(i) for i in expected]
    nulls = _post(tok_server, "tokenize", {"model": None, "prompt": "Hello world", "add_special_tokens": None,
                                           "return_token_strs": None}).json()
    assert nulls["tokens"] == expected  # null: the default


def test_tokenize_messages_uses_the_chat_template_flag(tok_server: ServerProcess,
                                                       tokenizer: Tokenizer) -> None:  # noqa: F811
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    body = _post(tok_server, "tokenize", {"model": NAME, "messages": messages}).json()
    assert body["tokens"] == tokenizer.encode(_render(messages), add_special_tokens=False).ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    no_prompt = _post(tok_server, "tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == tokenizer.encode(_render(messages, False), add_special_tokens=False).ids
    with_bos = _post(tok_server, "tokenize", {"messages": messages, "add_special_tokens": True}).json()
    assert with_bos["tokens"] == tokenizer.encode(_render(messages)).ids
    # continue_final_message: the last message left open (no closing tag, no generation prompt).
    partial = [*messages, {"role": "assistant", "content": "Sure, "}]
    cont = _post(tok_server, "tokenize", {"messages": partial, "continue_final_message": True,
                                          "add_generation_prompt": False}).json()
    open_text = _render(messages, False) + "<assistant>Sure,"
    assert cont["tokens"] == tokenizer.encode(open_text, add_special_tokens=False).ids
    # chat_template_kwargs are template variables.
    suffixed = _post(tok_server, "tokenize", {"messages": messages, "chat_template_kwargs": {"suffix": "!!"}})
    assert suffixed.json()["tokens"] == tokenizer.encode(_render(messages) + "!!", add_special_tokens=False).ids
    # The chat route renders with the same template.
    chat = httpx.post(f"{tok_server.url}/v1/chat/completions", timeout=60,
                      json={"model": NAME, "messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]


def test_detokenize(tok_server: ServerProcess, tokenizer: Tokenizer) -> None:  # noqa: F811
    ids = tokenizer.encode("Once upon a time").ids
    body = _post(tok_server, "detokenize", {"model": NAME, "tokens": ids}).json()
    assert body == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert body["prompt"].endswith("Once upon a time")
    round_trip = _post(tok_server, "tokenize", {"prompt": body["prompt"], "add_special_tokens": False}).json()
    assert round_trip["tokens"] == ids


@pytest.mark.parametrize("route, body, param", [
    ("tokenize", {"prompt": "hi", "bogus": 1}, "bogus"),
    ("tokenize", {"prompt": 5}, "prompt"),
    ("tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("tokenize", {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}, "prompt"),
    ("tokenize", {"messages": []}, "messages"),
    ("tokenize", {"messages": [{"content": "hi"}]}, "messages"),
    ("tokenize", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
                  "add_generation_prompt": True}, "continue_final_message"),
    ("tokenize", {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}, "chat_template"),
    ("tokenize", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools[0].function"),
    ("tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("tokenize", {}, "prompt"),
    ("detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ("detokenize", {"tokens": ["a"]}, "tokens"),
    ("detokenize", {"tokens": [1], "extra": True}, "extra"),
    ("detokenize", {}, "tokens"),
])
def test_bad_requests_are_400s_naming_the_field(tok_server: ServerProcess, route: str, body: dict[str, Any],
                                                param: str) -> None:
    response = _post(tok_server, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.slow
def test_unknown_model_and_non_json(tok_server: ServerProcess) -> None:
    for route, body in (("tokenize", {"model": "nope", "prompt": "hi"}), ("detokenize", {"model": "nope",
                                                                                          "tokens": [1]})):
        response = _post(tok_server, route, body)
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    raw = httpx.post(f"{tok_server.url}/tokenize", content=b"{not json", timeout=60,
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert _post(tok_server, "tokenize", ["a list"]).status_code == 400
