"""The reasoning parsers (`--reasoning-parser`) on fixed texts and fixed token streams:
the thinking and the answer apart, whole and streamed (tags split across pieces, pieces
cut at every character boundary), and one chat choice's whole pipeline: thinking, then
tool calls parsed from the answer only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.entrypoints.openai.chat_output import ChoiceOutputParser
from engine.entrypoints.openai.tool_parsers import ToolParserManager
from engine.reasoning import ReasoningParser, ReasoningParserManager
from engine.tokenizer import Tokenizer

# (parser, chat_template_kwargs, output, reasoning, content)
CASES = [
    ("deepseek_r1", {}, "<think>Two and two.\nSo four.</think>\n\nIt is 4.", "Two and two.\nSo four.", "\n\nIt is 4."),
    ("deepseek_r1", {}, "The template opened it.</think>Four.", "The template opened it.", "Four."),
    ("deepseek_r1", {}, "Cut off by max_tokens while still thinking", "Cut off by max_tokens while still thinking",
     None),
    ("deepseek_r1", {}, "Done.</think>", "Done.", None),
    ("qwen3", {}, "<think>\nHmm, a < b.\n</think>\n\nYes.", "\nHmm, a < b.\n", "\n\nYes."),
    ("qwen3", {"enable_thinking": False}, "No thinking at all.", None, "No thinking at all."),
    ("mistral", {}, "[THINK]Count: 1, 2.[/THINK]Two.", "Count: 1, 2.", "Two."),
    ("mistral", {}, "A plain answer [with brackets].", None, "A plain answer [with brackets]."),
]
# Token streams as a tokenizer gives them: tags as one token, or cut in pieces.
TOKEN_STREAMS = [
    ("deepseek_r1", ["<think>", "I", " add", ".", "</think>", "\n\n", "4"], "I add.", "\n\n4"),
    ("deepseek_r1", ["<", "th", "ink", ">", "I", " add", ".", "</", "think", ">", "4"], "I add.", "4"),
    ("qwen3", ["\n", "<think>", "a", "</th", "ink>", "b"], "a", "b"),
    ("mistral", ["So", ":", " [", "THINK", "]", "x", "[/", "THINK]", " done"], "x", "So:  done"),
]


def _parser(name: str, kwargs: dict | None = None) -> ReasoningParser:
    return ReasoningParserManager.get_reasoning_parser(name)(None, kwargs or {})


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str | None, str | None]:
    text, reasoning, content = "", "", ""
    for i, piece in enumerate(pieces):
        previous, text = text, text + piece
        delta = parser.extract_reasoning_streaming(previous, text, piece, finished=i == len(pieces) - 1)
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
    return reasoning or None, content or None


@pytest.mark.parametrize("name, kwargs, text, reasoning, content", CASES)
def test_whole_split(name: str, kwargs: dict, text: str, reasoning: str | None, content: str | None) -> None:
    assert _parser(name, kwargs).extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("name, kwargs, text, reasoning, content", CASES)
def test_streams_cut_anywhere_join_into_the_whole_split(name: str, kwargs: dict, text: str, reasoning: str | None,
                                                       content: str | None) -> None:
    for cut in range(len(text) + 1):
        assert _stream(_parser(name, kwargs), [text[:cut], text[cut:]]) == (reasoning, content), cut
    assert _stream(_parser(name, kwargs), list(text)) == (reasoning, content)


@pytest.mark.parametrize("name, pieces, reasoning, content", TOKEN_STREAMS)
def test_fixed_token_streams(name: str, pieces: list[str], reasoning: str, content: str) -> None:
    assert _stream(_parser(name), pieces) == (reasoning, content)
    assert _parser(name).extract_reasoning("".join(pieces)) == (reasoning, content)


def test_a_stream_never_shows_half_a_tag() -> None:
    parser = _parser("deepseek_r1")
    first = parser.extract_reasoning_streaming("", "<think>Hm</th", "<think>Hm</th")
    assert first is not None and (first.reasoning, first.content) == ("Hm", None)
    assert parser.extract_reasoning_streaming("<think>Hm</th", "<think>Hm</think>", "ink>") is None


def test_unknown_parser_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="deepseek_r1"):
        ReasoningParserManager.get_reasoning_parser("nope")


def test_reasoning_end_in_token_ids(serve_model: Path) -> None:
    tokenizer = Tokenizer.from_dir(serve_model)
    assert tokenizer is not None
    parser = ReasoningParserManager.get_reasoning_parser("deepseek_r1")(tokenizer)
    ids = tokenizer.encode("user: hi\nassistant:<think>a b", add_special_tokens=False)
    assert not parser.is_reasoning_end(ids)
    assert parser.is_reasoning_end(ids + tokenizer.encode("</think> answer", add_special_tokens=False))
    assert parser.reasoning_end_token_ids() == []  # "</think>" is several tokens of this vocabulary
    assert parser.prompt_ends_reasoning("assistant:<think>\n\n</think>\n\n")
    assert not parser.prompt_ends_reasoning("assistant:<think>\n")


HERMES_OUTPUT = ('<think>The user wants weather; call the tool.</think>\n\nChecking.\n<tool_call>\n'
                 '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
                 '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def _choice(include_reasoning: bool = True, max_calls: int | None = None) -> ChoiceOutputParser:
    return ChoiceOutputParser(_parser("qwen3"), ToolParserManager.get_tool_parser("hermes")(), include_reasoning,
                              max_calls)


@pytest.mark.parametrize("include_reasoning, max_calls", [(True, None), (False, None), (True, 1)])
def test_a_choice_splits_thinking_then_parses_calls_from_the_answer(include_reasoning: bool,
                                                                     max_calls: int | None) -> None:
    whole = _choice(include_reasoning, max_calls).whole(HERMES_OUTPUT)
    assert whole.reasoning == ("The user wants weather; call the tool." if include_reasoning else None)
    assert whole.content == "\n\nChecking.\n\n"
    cities = [json.loads(c.function.arguments)["city"] for c in whole.tool_calls]
    assert cities == (["Paris", "Rome"] if max_calls is None else ["Paris"])
    for size in (1, 3, 7):
        parser, text = _choice(include_reasoning, max_calls), ""
        reasoning, content, arguments = "", "", {}
        for i in range(0, len(HERMES_OUTPUT), size):
            text = HERMES_OUTPUT[:i + size]
            delta = parser.delta(text, finished=len(text) == len(HERMES_OUTPUT))
            reasoning += delta.reasoning or ""
            content += delta.content or ""
            for call in delta.tool_calls:
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
        assert (reasoning or None, content or None) == (whole.reasoning, whole.content)
        assert [arguments[i] for i in sorted(arguments)] == [c.function.arguments for c in whole.tool_calls]
        assert parser.called_tools


def test_a_tool_call_inside_the_thinking_is_not_a_call() -> None:
    text = '<think>Maybe <tool_call>{"name": "f", "arguments": {}}</tool_call>? No.</think>Just text.'
    whole = _choice().whole(text)
    assert whole.tool_calls == [] and whole.content == "Just text." and "tool_call" in (whole.reasoning or "")
