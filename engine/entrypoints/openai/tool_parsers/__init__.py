"""Tool-call parsers (vLLM's `vllm/tool_parsers`): `ToolParserManager.get_tool_parser(name)`
gives the class `--tool-call-parser NAME` names: ``hermes``, ``llama3_json``,
``mistral`` and ``pythonic``. `constrained_tool_parsers.py` reads the outputs of
tool_choice "required" and of a named function."""

from engine.entrypoints.openai.tool_parsers import (  # noqa: F401  (each registers its parser)
    hermes_tool_parser,
    llama_tool_parser,
    mistral_tool_parser,
    pythonic_tool_parser,
)
from engine.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaToolMessage,
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
    make_tool_call_id,
)

__all__ = ["DeltaToolMessage", "ExtractedToolCallInformation", "ToolParser", "ToolParserManager",
           "make_tool_call_id"]
