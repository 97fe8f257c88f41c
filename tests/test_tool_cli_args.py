"""The serve flags of tool calling, reasoning and usage (vLLM's names): a parser name
that is not registered is a start-up error listing the known ones; a
--tool-parser-plugin file registers its own parser before the names are checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.entrypoints.cli_args import parse_args, serving_options
from engine.entrypoints.openai.tool_parsers import ToolParserManager


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as raised:
        parse_args(argv)
    assert raised.value.code == 2
    return capsys.readouterr().err


def test_unknown_parsers_exit_2_listing_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(["--tool-call-parser", "hermes2"], capsys)
    assert "'hermes2' is not known" in err and "hermes" in err and "pythonic" in err
    err = _error(["--reasoning-parser", "r2"], capsys)
    assert "'r2' is not known" in err and "deepseek_r1" in err and "qwen3" in err
    assert "requires --tool-call-parser" in _error(["--enable-auto-tool-choice"], capsys)
    assert "not a Python file" in _error(["--tool-parser-plugin", "/no/such/plugin.py"], capsys)


def test_flags_reach_the_app(tmp_path: Path) -> None:
    args = parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", "--reasoning-parser",
                       "deepseek_r1", "--enable-prompt-tokens-details"])
    assert serving_options(args) == {"enable_auto_tool_choice": True, "tool_call_parser": "llama3_json",
                                     "reasoning_parser": "deepseek_r1", "enable_prompt_tokens_details": True}
    assert serving_options(parse_args([])) == {"enable_auto_tool_choice": False, "tool_call_parser": None,
                                               "reasoning_parser": None, "enable_prompt_tokens_details": False}


def test_a_plugin_registers_its_parser(tmp_path: Path) -> None:
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from engine.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager\n"
        "from engine.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedOutput\n\n"
        "@ToolParserManager.register_module('my_format')\n"
        "class MyParser(ToolParser):\n"
        "    def parse(self, text, finished):\n"
        "        return ParsedOutput(content=text)\n")
    try:
        args = parse_args(["--tool-parser-plugin", str(plugin), "--tool-call-parser", "my_format"])
        assert args.tool_call_parser == "my_format"
        assert ToolParserManager.get_tool_parser("my_format")().extract_tool_calls("hi").content == "hi"
    finally:
        ToolParserManager.tool_parsers.pop("my_format", None)
