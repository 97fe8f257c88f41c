"""What the structured-output package shares: a constraint in the form it travels in.

`normalize` is called by the Processor (engine/processor.py) on every constrained
request, before its SamplingParams are queued and, later, sent to the ranks inside a
step, and by the backend before it compiles a schema.
"""

from __future__ import annotations

import dataclasses
import json

from config import StructuredOutputsParams


def normalize(params: StructuredOutputsParams) -> StructuredOutputsParams:
    """``params`` as it may travel to the ranks inside a step's SamplingParams: a JSON
    schema round-tripped through JSON text (plain str keys and JSON values, which the
    step's typed wire format decodes; `True`, the schema admitting anything, becomes
    ``{}``). Raises ValueError naming the field for a schema that is no JSON (a non-str
    key, a set) or is `false`, which admits no output."""
    if params.json is None:
        return params
    if params.json is False:
        raise ValueError("structured_outputs.json: the schema false admits no output")
    try:
        schema = {} if params.json is True else json.loads(json.dumps(params.json))
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json is not a JSON schema: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {schema!r}")
    return dataclasses.replace(params, json=schema)
