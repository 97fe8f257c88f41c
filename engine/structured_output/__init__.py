"""Structured outputs (vLLM's `v1/structured_output/`): constraints compiled to grammars
in the engine, one matcher per sample, and the token bitmask each step carries to the
ranks' samplers. See manager.py for the flow."""

from engine.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from engine.structured_output.manager import GRAMMAR_CACHE_SIZE, StructuredOutputManager, grammar_bitmask, step_grammar
from engine.structured_output.request import StructuredOutputRequest
from engine.structured_output.utils import normalize

__all__ = [
    "GRAMMAR_CACHE_SIZE",
    "StructuredOutputBackend",
    "StructuredOutputGrammar",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "grammar_bitmask",
    "normalize",
    "step_grammar",
]
