"""What a request's tool choice asks of the engine (vLLM's `_get_json_schema_from_tool`
and `--tool-strict-level auto`): the `StructuredOutputsParams` that make its output
parse as calls, or None for a free output.

* "required": a JSON list of at least one ``{"name": <a tool's name>, "parameters":
  <that tool's parameters schema>}`` (at most one when ``parallel_tool_calls`` is
  false); shared ``$defs`` are lifted to the list's schema.
* a named function: that function's parameters schema (any object when it has none).
* "auto" with a tool marked ``strict``: the parser's structural tag, which pins the
  strict tools' arguments once a call opens (None when the format has none).

Called by the chat handler on the event loop; raises `ToolRequestError` for tools whose
``$defs`` disagree. Schemas the grammar backend cannot compile are its 400s, raised
when the request is added.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

from config import StructuredOutputsParams
from engine.entrypoints.openai.protocol_tools import FunctionDefinition, ToolRequestError
from engine.entrypoints.openai.tool_parsers import ToolParser

logger = logging.getLogger(__name__)

ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
NAMED_PREFIX = "function:"


def named_function(choice: str) -> str | None:
    """The function a resolved tool choice names (see `resolve_tools`), else None."""
    return choice[len(NAMED_PREFIX):] if choice.startswith(NAMED_PREFIX) else None


def required_schema(tools: list[FunctionDefinition], parallel_tool_calls: bool) -> dict[str, Any]:
    """The JSON schema of tool_choice "required" (see the module docstring)."""
    all_defs: dict[str, Any] = {}
    variants = []
    for i, tool in enumerate(tools):
        parameters = copy.deepcopy(tool.parameters) if tool.parameters else dict(ANY_OBJECT)
        for name, schema in parameters.pop("$defs", {}).items():
            if name in all_defs and all_defs[name] != schema:
                raise ToolRequestError(f"tools[{i}].function.parameters",
                                       f"tools define $defs {name!r} differently; tool_choice 'required' "
                                       "needs one schema per name")
            all_defs[name] = schema
        variants.append({"properties": {"name": {"type": "string", "enum": [tool.name]}, "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if all_defs:
        schema["$defs"] = all_defs
    return schema


def tool_choice_constraint(tools: list[FunctionDefinition], choice: str, parallel_tool_calls: bool,
                           tool_parser: ToolParser | None) -> StructuredOutputsParams | None:
    """The constraint the resolved ``choice`` puts on the output, or None."""
    if choice == "required":
        return StructuredOutputsParams(json=required_schema(tools, parallel_tool_calls))
    name = named_function(choice)
    if name is not None:
        tool = next(t for t in tools if t.name == name)
        return StructuredOutputsParams(json=copy.deepcopy(tool.parameters) if tool.parameters else dict(ANY_OBJECT))
    if choice == "auto" and tool_parser is not None and any(t.strict for t in tools):
        tag = tool_parser.structural_tag(tools)
        if tag is None:
            logger.warning("tools marked strict are not enforced under tool_choice 'auto': the %s format has no "
                           "structural tag; use tool_choice 'required' or a named function",
                           type(tool_parser).__name__)
            return None
        return StructuredOutputsParams(structural_tag=json.dumps(tag))
    return None
