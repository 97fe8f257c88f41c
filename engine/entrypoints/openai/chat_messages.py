"""A chat request's messages as its chat template receives them (vLLM's
`chat_utils` conventions): each message's text, its name; an assistant's tool calls
with their arguments parsed from JSON text to a dict (what tool-use templates expect,
as transformers documents); a tool result's `tool_call_id`; an assistant's thinking
under both `reasoning` and `reasoning_content` (templates use either name).

Called by the chat handler on the event loop; raises `ToolRequestError` naming the
message field at fault (a part that is not text, a call without a function name,
arguments that are not JSON), which the handler turns into a 400.
"""

from __future__ import annotations

import json
from typing import Any

from engine.entrypoints.openai.protocol import ChatMessage
from engine.entrypoints.openai.protocol_tools import ToolRequestError


def _tool_calls(i: int, calls: list[Any]) -> list[dict[str, Any]]:
    rendered = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolRequestError(f"{where}.function", f"{where} must be {{'id': ..., 'type': 'function', "
                                                        "'function': {'name': ..., 'arguments': '<JSON>'}}")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments.strip():
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ToolRequestError(f"{where}.function.arguments",
                                       f"{where}.function.arguments is not valid JSON: {e}") from None
        elif not isinstance(arguments, (dict, list)):
            arguments = {}
        rendered.append({**call, "type": call.get("type", "function"), "function": {**function,
                                                                                   "arguments": arguments}})
    return rendered


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as template variables (see the module docstring)."""
    rendered = []
    for i, message in enumerate(messages):
        try:
            text = message.text()
        except ValueError as e:
            raise ToolRequestError(f"messages[{i}].content", str(e)) from None
        item: dict[str, Any] = {"role": message.role, "content": text}
        if message.name:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = _tool_calls(i, message.tool_calls)
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
        if reasoning is not None:
            item["reasoning"] = item["reasoning_content"] = reasoning
        rendered.append(item)
    return rendered
