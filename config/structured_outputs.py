"""Structured-output constraints: what a request's output must match (vLLM 0.32's names).

`StructuredOutputsParams` is `SamplingParams.structured_outputs`: exactly one
constraint (``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` or
``structural_tag``) plus options that shape how it is compiled. Construction checks
only the shape of the values (one constraint, the right types); whether a schema,
regex or grammar compiles is the engine's structured-output backend's question
(engine/structured_output/), which raises a ValueError naming the field at
`add_request`, before the request is scheduled.

`StructuredOutputsConfig` is the engine-wide choice (`--structured-outputs-config`,
vLLM's shape): which backend compiles grammars.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields
from typing import Any

from config.utils import ConfigError

#: Backends `StructuredOutputsConfig.backend` accepts ("auto" picks xgrammar, as vLLM does).
STRUCTURED_OUTPUT_BACKENDS: tuple[str, ...] = ("auto", "xgrammar")

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One request's constraint.

    * ``json``: a JSON schema (a dict, or its text); the output is one JSON value valid
      against it.
    * ``regex``: the output matches this regular expression.
    * ``choice``: the output is exactly one of these strings.
    * ``grammar``: an EBNF (GBNF) grammar, as vLLM's xgrammar backend takes it (a
      ``root`` rule).
    * ``json_object``: ``True``: the output is some JSON object.
    * ``structural_tag``: xgrammar's structural tag, as its JSON text.
    * ``disable_any_whitespace``: no whitespace between JSON tokens beyond what the
      compact form needs.
    * ``disable_additional_properties``: a schema's objects take no properties beyond
      those it lists (``additionalProperties: false`` where the schema does not say).
    * ``whitespace_pattern``: accepted for vLLM compatibility by the guidance backend
      only; the xgrammar backend refuses it.
    * ``reasoning_end_token_ids``: the constraint applies only after the first of these
      tokens in the output (a reasoning model's end of thinking, e.g. ``</think>``: set
      by the chat server's reasoning parser); None: from the first token.

    Raises ValueError naming the field when none or several constraints are given or a
    value has the wrong type.
    """

    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    reasoning_end_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of " + ", ".join(_CONSTRAINTS)
                + (f"; got {', '.join(given)}" if given else "; got none")
            )
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except _json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.reasoning_end_token_ids is not None:
            ids = self.reasoning_end_token_ids
            if (not isinstance(ids, (list, tuple)) or not ids
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
                raise ValueError(f"structured_outputs.reasoning_end_token_ids must be a non-empty list of token "
                                 f"ids, got {ids!r}")
            self.reasoning_end_token_ids = list(ids)
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {value!r}")

    @property
    def kind(self) -> str:
        """The constraint's field name: "json", "regex", "choice", "grammar", "json_object" or "structural_tag"."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        """(kind, canonical text): equal keys compile to the same grammar, so the
        engine compiles each once."""
        value: Any = getattr(self, self.kind)
        text = value if isinstance(value, str) else _json.dumps(value, sort_keys=True, separators=(",", ":"))
        options = (self.disable_any_whitespace, self.disable_additional_properties, self.whitespace_pattern)
        return self.kind, f"{text}\x00{options!r}"

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> StructuredOutputsParams:
        """From a request's JSON object; an unknown key is a ValueError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**value)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Engine-wide structured-output settings (`--structured-outputs-config`)."""

    backend: str = "auto"
    #: The default of every request's ``disable_any_whitespace`` (a request may set it too).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ConfigError(f"structured_outputs_config.backend={self.backend!r} is not supported; "
                              f"choose one of {list(STRUCTURED_OUTPUT_BACKENDS)}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ConfigError("structured_outputs_config.disable_any_whitespace must be a bool, "
                              f"got {self.disable_any_whitespace!r}")
