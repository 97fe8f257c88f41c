"""The xgrammar backend (vLLM's default): JSON schemas, regexes, choices, EBNF grammars
and structural tags compiled against this engine's tokenizer.

`XgrammarBackend(tokenizer, vocab_size, stop_token_ids)` builds xgrammar's
`TokenizerInfo` once (the vocabulary as the tokenizer spells it, its byte-level /
byte-fallback / raw type read from tokenizer.json) and one `GrammarCompiler` with its
own cache off: the manager caches compiled grammars itself (by
`StructuredOutputsParams.cache_key()`, LRU-bounded), so that compilations can be
counted and bounded. A constraint that does not compile, or a JSON-schema keyword that
xgrammar would silently ignore (`UNSUPPORTED_SCHEMA_KEYWORDS`), is a ValueError whose
message begins with the field at fault. xgrammar is imported here, lazily by the
manager: an engine that never sees a constrained request never loads it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from config import StructuredOutputsParams
from engine.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from engine.structured_output.utils import normalize

# JSON-schema keywords xgrammar 0.2 accepts but does not enforce (checked by hand:
# `{"uniqueItems": true}` still admits [1, 1], `not` admits what it negates): a request
# using one would get output that fails its own schema, so it is refused instead.
UNSUPPORTED_SCHEMA_KEYWORDS = ("uniqueItems", "not", "if", "then", "else", "dependentSchemas",
                               "dependentRequired", "dependencies", "unevaluatedItems")
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ": the rest is the message.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def _clean(error: Exception) -> str:
    return _CPP_PREFIX.sub("", str(error)).strip()


def unsupported_schema_feature(schema: Any, path: str = "") -> str | None:
    """The first keyword of ``schema`` (at its JSON pointer) that xgrammar cannot enforce:
    one of `UNSUPPORTED_SCHEMA_KEYWORDS` with a meaningful value, or a ``$ref`` that is
    not local (``#...``); None if there is none."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = unsupported_schema_feature(item, f"{path}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key in UNSUPPORTED_SCHEMA_KEYWORDS:
        if key in schema and schema[key] not in (False, None) and not (key == "uniqueItems" and not schema[key]):
            return f"{key!r} at {path or '/'}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"a remote $ref {ref!r} at {path or '/'}"
    for key, value in schema.items():
        if key in ("enum", "const", "default", "examples"):
            continue  # values, not schemas
        found = unsupported_schema_feature(value, f"{path}/{key}")
        if found:
            return found
    return None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose root matches exactly one of ``choices``, each as written
    (every character outside printable ASCII, and the quote and backslash, escaped)."""
    def literal(text: str) -> str:
        out = []
        for ch in text:
            if ch in '"\\' or not " " <= ch <= "~":
                out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of our tokenizer (engine/tokenizer.py): each id's token as the
    vocabulary spells it and the vocabulary type read from its tokenizer.json. Ids it
    lacks (up to the logits' ``vocab_size``) and its special tokens are "", which
    xgrammar never allows as text: detokenised output skips special tokens, so "<s>"
    emitted inside a JSON string would vanish from the text the grammar checked."""
    backend = tokenizer.backend_tokenizer  # xgrammar reads its JSON for the vocabulary type
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    size = min(tokenizer.vocab_size, vocab_size)
    encoded = tokenizer.convert_ids_to_tokens(range(size))
    for token_id, added in backend.get_added_tokens_decoder().items():
        if added.special and token_id < size:
            encoded[token_id] = ""
    return xgr.TokenizerInfo(encoded, metadata["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids) or None,
                             add_prefix_space=metadata["add_prefix_space"])


class XgrammarGrammar(StructuredOutputGrammar):
    """One sample's `xgr.GrammarMatcher` (rollback is unlimited in xgrammar 0.2)."""

    def __init__(self, compiled: xgr.CompiledGrammar, terminate_without_stop_token: bool) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=terminate_without_stop_token)

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    """Compiles with xgrammar for one tokenizer. ``stop_token_ids`` (the model's EOS ids)
    are what a complete grammar allows next; with none, a matcher terminates as soon as
    its grammar is complete. JSON schemas compile in xgrammar's strict mode, as vLLM's:
    an object takes no property its schema does not list unless the schema allows more,
    so ``disable_additional_properties`` (and ``strict``) need nothing further here."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._terminate_without_stop_token = not stop_token_ids
        # Our own LRU cache (the manager's) decides what stays compiled.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams, any_whitespace: bool) -> xgr.CompiledGrammar:
        kind = params.kind
        field = f"structured_outputs.{kind}"
        if params.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend "
                             "(use disable_any_whitespace)")
        try:
            if kind == "json":
                feature = unsupported_schema_feature(params.json)
                if feature:
                    raise ValueError(f"{field}: the JSON schema uses {feature}, which the xgrammar backend "
                                     "cannot enforce")
                return self.compiler.compile_json_schema(json.dumps(normalize(params).json),
                                                         any_whitespace=any_whitespace,
                                                         strict_mode=True)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(params.choice))
            if kind == "grammar":
                return self.compiler.compile_grammar(params.grammar)
            return self._compile_structural_tag(params.structural_tag)
        except ValueError as e:
            if str(e).startswith(field):
                raise
            raise ValueError(f"{field} is invalid: {_clean(e)}") from None
        except Exception as e:  # noqa: BLE001 - xgrammar's RuntimeError, TypeError, its own errors; a KeyError
            what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                    "choice": "choice", "grammar": "grammar", "structural_tag": "structural tag"}[kind]
            raise ValueError(f"{field} is not a valid {what}: {_clean(e)}") from None

    def _compile_structural_tag(self, text: str) -> xgr.CompiledGrammar:
        """vLLM's two forms: the legacy {"structures": [{begin, schema, end}], "triggers"}
        and xgrammar's own structural tag (any other JSON object)."""
        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return self.compiler.compile_structural_tag(items, tag.get("triggers", []))
        return self.compiler.compile_structural_tag(text)

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(compiled, self._terminate_without_stop_token)
