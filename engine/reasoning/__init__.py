"""Reasoning parsers: a reasoning model's thinking apart from its answer (vLLM's
`vllm/reasoning`). `ReasoningParserManager.get_reasoning_parser(name)` gives the class
`--reasoning-parser NAME` names; `think_parsers.py` holds the formats we serve."""

from engine.reasoning import think_parsers as _think_parsers  # noqa: F401  (registers the parsers)
from engine.reasoning.abs_reasoning_parsers import DeltaReasoning, ReasoningParser, ReasoningParserManager

__all__ = ["DeltaReasoning", "ReasoningParser", "ReasoningParserManager"]
