"""The tool-calling part of the chat API (vLLM's names): the shapes of `tools`,
`tool_choice` and the calls in responses, and the checks on a request's tools.

`resolve_tools(tools, tool_choice)` is called by the chat handler on the event loop,
before anything is queued: it returns the tools as `FunctionDefinition`s and the
effective choice ("none" | "auto" | "required" | the named function's name), or raises
`ToolRequestError` naming the field at fault (`tools[1].function.name`,
`tool_choice`), which the handler turns into a 400. The defaults are vLLM's: no
`tool_choice` means "auto" when tools are given, else "none"; "required" with an
empty `tools` means "none", as OpenAI answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel

_CHOICES = ("none", "auto", "required")


class ToolRequestError(ValueError):
    """A request's tools or tool_choice is malformed; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class FunctionDefinition:
    """One function tool: its name, description, parameters' JSON schema (None: takes
    any arguments) and whether its arguments must validate against it (``strict``)."""

    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: bool = False


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    """One piece of a streamed call: the first has ``id``, ``type`` and the name."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


ToolChoice = Union[Literal["none", "auto", "required"], str]


def _check_function(i: int, tool: Any) -> FunctionDefinition:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ToolRequestError(where, f"{where} must be an object {{'type': 'function', 'function': {{...}}}}")
    if tool.get("type", "function") != "function":
        raise ToolRequestError(f"{where}.type", f"{where}.type={tool.get('type')!r} is not supported: only "
                                                "'function' tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolRequestError(f"{where}.function", f"{where}.function must be an object with a 'name'")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ToolRequestError(f"{where}.function.name", f"{where}.function.name must be a non-empty string")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolRequestError(f"{where}.function.description", f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolRequestError(f"{where}.function.parameters",
                               f"{where}.function.parameters must be a JSON schema object, got {parameters!r}")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolRequestError(f"{where}.function.strict", f"{where}.function.strict must be a bool")
    return FunctionDefinition(name, description, parameters, bool(strict))


def resolve_tools(tools: Optional[list[Any]], tool_choice: Any) -> tuple[list[FunctionDefinition], str]:
    """The request's tools and its effective tool choice: "none", "auto", "required", or
    the named function's name (prefixed ``function:``). Raises ToolRequestError."""
    functions = [_check_function(i, tool) for i, tool in enumerate(tools or [])]
    names = [f.name for f in functions]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ToolRequestError("tools", f"tools: the function name {duplicate!r} is given more than once")
    if tool_choice is None:
        return functions, "auto" if functions else "none"
    if tool_choice == "none":
        return functions, "none"
    if tools is None:
        raise ToolRequestError("tool_choice", "When using `tool_choice`, `tools` must be set.")
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise ToolRequestError("tool_choice", f"Invalid value for `tool_choice`: {tool_choice!r}! Only named "
                                                  'tools, "none", "auto" or "required" are supported.')
        return functions, "none" if tool_choice == "required" and not functions else tool_choice
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(function, dict) or tool_choice.get("type", "function") != "function":
        raise ToolRequestError("tool_choice", f"Invalid value for `tool_choice`: {tool_choice!r}. {usage}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ToolRequestError("tool_choice", f"Expected a non-empty `name` in `function` in `tool_choice`! {usage}")
    if name not in names:
        raise ToolRequestError("tool_choice", f"The tool specified in `tool_choice` ({name!r}) does not match any "
                                              f"of the specified `tools` ({names})")
    return functions, f"function:{name}"
