"""The tool-call parsers (`--tool-call-parser`), the readers of constrained tool
choices, and the request-side checks and constraints of tools, on fixed texts: every
format's calls and content, whole and streamed (split at every character boundary and
in token-like pieces), always joining into the same message."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from engine.entrypoints.openai.chat_messages import template_messages
from engine.entrypoints.openai.protocol import ChatMessage
from engine.entrypoints.openai.protocol_tools import FunctionDefinition, ToolRequestError, resolve_tools
from engine.entrypoints.openai.tool_choice import required_schema, tool_choice_constraint
from engine.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from engine.entrypoints.openai.tool_parsers.constrained_tool_parsers import NamedToolParser, RequiredToolParser

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}

# (parser, output, expected content, expected [(name, arguments as a dict)])
CASES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", '
               '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": [1, {"b": "}"}]}}\n'
               '</tool_call>', "Let me look.\n\n",
     [("get_weather", {"city": 'Paris, "FR"', "days": 3}), ("add", {"a": [1, {"b": "}"}]})]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {}}', None, [("add", {})]),  # stopped at the end tag
    ("hermes", "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "add", "arguments": '
                    '{"a": 2}}', None, [("get_weather", {"city": "Rome"}), ("add", {"a": 2})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1.5}}', None, [("add", {"a": 1.5})]),
    ("llama3_json", "The answer is {not a call}.", "The answer is {not a call}.", []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "add", '
                '"arguments": {"a": 1}}]', "Sure. ", [("get_weather", {"city": "Oslo"}), ("add", {"a": 1})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]add[ARGS]{"a": [1, 2]}', None,
     [("get_weather", {"city": "Oslo"}), ("add", {"a": [1, 2]})]),
    ("pythonic", '[get_weather(city="Paris, [FR]", days=2), add(a=-1.5)]', None,
     [("get_weather", {"city": "Paris, [FR]", "days": 2}), ("add", {"a": -1.5})]),
    ("pythonic", "<|python_start|>[add(a={'x': (1, 2)})]<|python_end|>", None, [("add", {"a": {"x": [1, 2]}})]),
    ("pythonic", "A plain answer.", "A plain answer.", []),
]


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """Feed ``pieces`` in order; the joined content, each call's (name, arguments) and ids."""
    text, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        previous, text = text, text + piece
        delta = parser.extract_tool_calls_streaming(previous, text, piece, finished=i == len(pieces) - 1)
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls:
            if call.index not in calls:
                assert call.id and call.id.startswith("chatcmpl-tool-") and call.function and call.function.name
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and call.function is not None and call.function.name is None
            calls[call.index]["arguments"] += call.function.arguments or ""
    ordered = [calls[i] for i in sorted(calls)]
    return content or None, [(c["name"], c["arguments"]) for c in ordered], [c["id"] for c in ordered]


def _whole(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    info = parser.extract_tool_calls(text)
    assert info.tools_called == bool(info.tool_calls)
    return info.content, [(c.function.name, c.function.arguments) for c in info.tool_calls]


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_output_gives_the_calls_and_the_text_around_them(name: str, text: str, content: str | None,
                                                               calls: list[tuple[str, Any]]) -> None:
    parser = ToolParserManager.get_tool_parser(name)()
    got_content, got_calls = _whole(parser, text)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got_calls] == calls


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_stream_split_anywhere_joins_into_the_whole_message(name: str, text: str, content: str | None,
                                                            calls: list[tuple[str, Any]]) -> None:
    cls = ToolParserManager.get_tool_parser(name)
    whole = _whole(cls(), text)
    for cut in range(len(text) + 1):  # two pieces, cut at every character boundary
        streamed = _stream(cls(), [text[:cut], text[cut:]])
        assert streamed[:2] == whole, cut
    for size in (1, 2, 3, 5, 8):  # token-like pieces
        content_, calls_, ids = _stream(cls(), _pieces(text, size))
        assert (content_, calls_) == whole and len(set(ids)) == len(ids), size


def test_a_call_whose_json_is_broken_leaves_the_output_as_content() -> None:
    text = 'I will call it <tool_call>{"name": "add", "arguments": {"a": }}</tool_call>'
    assert _whole(ToolParserManager.get_tool_parser("hermes")(), text) == (text, [])
    cut = 'Thinking <tool_call>{"name": "add", "arguments": {"a": 1'  # max_tokens hit mid-call
    assert _whole(ToolParserManager.get_tool_parser("hermes")(), cut) == (cut, [])


def test_stream_holds_back_a_tag_start_until_it_knows() -> None:
    parser = ToolParserManager.get_tool_parser("hermes")()
    first = parser.extract_tool_calls_streaming("", "Hello <tool_", "Hello <tool_")
    assert first is not None and first.content == "Hello"  # the blank and the tag's start are held
    last = parser.extract_tool_calls_streaming("Hello <tool_", "Hello <tool_box", "box", finished=True)
    assert last is not None and last.content == " <tool_box" and not last.tool_calls


def test_mistral_keeps_special_tokens_in_the_text() -> None:
    class Body:
        skip_special_tokens = True

    body = ToolParserManager.get_tool_parser("mistral")().adjust_request(Body())
    assert body.skip_special_tokens is False


def test_required_and_named_outputs_read_directly() -> None:
    required = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "add", "parameters": {}}]'
    assert _whole(RequiredToolParser(), required) == (None, [("get_weather", '{"city": "Paris"}'), ("add", "{}")])
    named = ' {"city": "Paris", "days": 2}'
    assert _whole(NamedToolParser("get_weather"), named) == (None, [("get_weather", '{"city": "Paris", "days": 2}')])
    for parser_cls, text in ((RequiredToolParser, required), (lambda: NamedToolParser("get_weather"), named)):
        for size in (1, 4):
            assert _stream(parser_cls(), _pieces(text, size))[:2] == _whole(parser_cls(), text)
    assert _whole(RequiredToolParser(), "[]") == ("[]", [])  # not a call: content, as vLLM cannot parse it


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "function", "function": {"name": ""}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": WEATHER}, {"type": "retrieval"}], None, "tools[1].type"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, "tools[0].function.strict"),
    ([{"type": "function", "function": WEATHER}] * 2, None, "tools"),
    ([{"type": "function", "function": WEATHER}], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([{"type": "function", "function": WEATHER}], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_and_tool_choices_name_their_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(ToolRequestError) as raised:
        resolve_tools(tools, choice)
    assert raised.value.param == param


def test_tool_choice_defaults_are_vllms() -> None:
    tools = [{"type": "function", "function": WEATHER}]
    assert resolve_tools(tools, None)[1] == "auto"
    assert resolve_tools(None, None) == ([], "none")
    assert resolve_tools([], "required")[1] == "none"  # as OpenAI: nothing to call
    named = resolve_tools(tools, {"type": "function", "function": {"name": "get_weather"}})
    assert named[1] == "function:get_weather" and named[0][0].parameters == WEATHER["parameters"]


def _accepts(schema: dict[str, Any], text: str) -> bool:
    return _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), text)


def test_required_schema_admits_only_calls_of_the_tools() -> None:
    tools = [FunctionDefinition(**WEATHER), FunctionDefinition(**ADD)]
    schema = required_schema(tools, parallel_tool_calls=True)
    assert _accepts(schema, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                            '{"name": "add", "parameters": {"a": 2}}]')
    assert not _accepts(schema, '[{"name": "get_weather", "parameters": {"days": 2}}]')  # city is required
    assert not _accepts(schema, '[{"name": "other", "parameters": {}}]')
    assert not _accepts(schema, "[]")
    single = required_schema(tools, parallel_tool_calls=False)
    assert single["maxItems"] == 1 and not _accepts(single, '[{"name": "add", "parameters": {}}, '
                                                            '{"name": "add", "parameters": {}}]')


def test_constraints_of_each_tool_choice() -> None:
    tools = [FunctionDefinition(**WEATHER), FunctionDefinition(**ADD, strict=True)]
    hermes = ToolParserManager.get_tool_parser("hermes")()
    assert tool_choice_constraint(tools, "none", True, hermes) is None
    named = tool_choice_constraint(tools, "function:get_weather", True, None)
    assert named is not None and named.json == WEATHER["parameters"]
    assert tool_choice_constraint([FunctionDefinition(**WEATHER)], "auto", True, hermes) is None  # none strict
    strict = tool_choice_constraint(tools, "auto", True, hermes)
    assert strict is not None and strict.structural_tag is not None
    grammar = xgr.Grammar.from_structural_tag(strict.structural_tag)
    assert _is_grammar_accept_string(grammar, 'Sure <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    assert not _is_grammar_accept_string(grammar, '<tool_call>\n{"name": "add", "arguments": {"a": "x"}}\n'
                                                  "</tool_call>")  # a strict tool's arguments are pinned
    assert tool_choice_constraint(tools, "auto", True, ToolParserManager.get_tool_parser("pythonic")()) is None


def test_history_tool_calls_reach_the_template_as_dicts() -> None:
    messages = [ChatMessage(role="user", content="Weather?"),
                ChatMessage(role="assistant", tool_calls=[{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}], reasoning_content="Look it up."),
                ChatMessage(role="tool", content="sunny", tool_call_id="c1")]
    rendered = template_messages(messages)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert rendered[1]["reasoning"] == rendered[1]["reasoning_content"] == "Look it up."
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    bad = ChatMessage(role="assistant", tool_calls=[{"function": {"name": "f", "arguments": "{oops"}}])
    with pytest.raises(ToolRequestError) as raised:
        template_messages([bad])
    assert raised.value.param == "messages[0].tool_calls[0].function.arguments"
