"""The request fields that constrain the output: OpenAI's `response_format` and vLLM
0.32's `structured_outputs`, mapped onto `SamplingParams.structured_outputs`.

`response_format` is ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` or vLLM's
``{"type": "structural_tag", ...}``; `structured_outputs` is vLLM's dict (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag`` and the options).
The ``guided_*`` fields vLLM 0.32 removed are refused, pointing at `structured_outputs`.
Every refusal is an `APIError` 400 whose ``param`` names the field at fault
(``response_format.json_schema``, ``structured_outputs.regex``, ``guided_json``, ...).

Called on the request's thread by the handlers (through `_SamplingFields.unsupported_fields`
for the shape, and `structured_outputs_params` when the SamplingParams are built, whose
``check`` compiles the constraint in the engine, once per text).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from config import StructuredOutputsParams
from engine.entrypoints.openai.api_error import APIError

#: Removed in vLLM 0.32 (vLLM's PR #22772 deprecated them): each with its structured_outputs key.
REMOVED_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                         "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern",
                         "guided_decoding_backend": None}
_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
_FIELD = re.compile(r"^structured_outputs\.(\w+)")


def removed_guided_fields(body: Any) -> list[tuple[str, str]]:
    """(param, message) for each ``guided_*`` field the request sets."""
    problems = []
    for name, key in REMOVED_GUIDED_FIELDS.items():
        if getattr(body, name, None) is not None:
            use = (f'structured_outputs: {{"{key}": ...}}' if key
                   else '--structured-outputs-config \'{"backend": ...}\' on the server')
            problems.append((name, f"{name} was removed in vLLM 0.32 and is not supported: use {use}"))
    return problems


def _from_response_format(response_format: Any) -> StructuredOutputsParams | None:
    if not isinstance(response_format, dict):
        raise APIError(400, f"response_format must be an object, got {response_format!r}", param="response_format")
    kind = response_format.get("type", "text")
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise APIError(400, f"response_format.type={kind!r} is not supported; use one of "
                            f"{list(_RESPONSE_FORMAT_TYPES)}", param="response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=json.dumps(response_format))
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise APIError(400, "response_format.json_schema must be an object with a JSON schema object in its "
                            f"'schema' (and a 'name'), got {spec!r}", param="response_format.json_schema")
    return StructuredOutputsParams(json=spec["schema"], disable_additional_properties=spec.get("strict") is True)


def structured_outputs_params(body: Any, check: Callable[[StructuredOutputsParams], Any] | None = None
                              ) -> StructuredOutputsParams | None:
    """The request's constraint, or None. ``check`` (the engine processor's
    `check_structured_outputs`) compiles it, so that a schema, regex or grammar that does
    not compile is refused here naming the request's own field. Raises APIError (400)."""
    response_format = getattr(body, "response_format", None)
    raw = getattr(body, "structured_outputs", None)
    constraint = None if response_format is None else _from_response_format(response_format)
    origin = "response_format.json_schema" if constraint is not None and constraint.json is not None \
        else "response_format"
    if raw is not None:
        if constraint is not None:
            raise APIError(400, "give either response_format (json_object / json_schema) or structured_outputs, "
                                "not both", param="structured_outputs")
        if not isinstance(raw, dict):
            raise APIError(400, f"structured_outputs must be an object, got {raw!r}", param="structured_outputs")
        try:
            constraint = StructuredOutputsParams.from_dict(raw)
        except (ValueError, TypeError) as e:
            match = _FIELD.match(str(e))
            raise APIError(400, str(e), param=f"structured_outputs.{match.group(1)}" if match
                           else "structured_outputs") from None
        origin = None
    if constraint is None or check is None:
        return constraint
    try:
        check(constraint)
    except ValueError as e:
        message = str(e)
        match = _FIELD.match(message)
        param = match.group(0) if match else "structured_outputs"
        if origin is not None:  # say it in the request's own words
            message, param = message.replace(param, origin, 1), origin
        raise APIError(400, message, param=param) from None
    return constraint


def structured_output_problems(body: Any) -> list[tuple[str, str]]:
    """(param, message) for the removed ``guided_*`` fields and a constraint of the wrong
    shape (a compile error needs the engine: `structured_outputs_params` with ``check``)."""
    problems = removed_guided_fields(body)
    try:
        structured_outputs_params(body)
    except APIError as e:
        problems.append((e.param or "structured_outputs", e.message))
    return problems
