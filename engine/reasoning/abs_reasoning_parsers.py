"""`ReasoningParser`: splits a reasoning model's output into its thinking and its answer
(vLLM's `vllm/reasoning/abs_reasoning_parsers.py`), and the registry of parsers by the
name `--reasoning-parser` takes.

Called by the chat handler (engine/entrypoints/openai/), on the event loop: one
instance per choice of a request, `ReasoningParserManager.get_reasoning_parser(name)(
tokenizer, chat_template_kwargs)` (the request's kwargs can change the split; the
streamed split keeps no state of its own). It works on text, not token ids: the tags (`<think>`, `</think>`, `[THINK]`) may be one special
token or several plain ones, depending on the tokenizer, and both must split alike.

The streamed split is the whole split of each prefix of the text, less a tail that
could still be the start of a tag (a tag split across tokens is never shown half), so
the deltas of a stream always join into the whole split of the final text.
`is_reasoning_end(token_ids)` says whether the thinking has ended in these ids (the
engine's structured-output side needs it to start applying a grammar only after).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.parser_registry import ParserRegistry, held_tail
from engine.tokenizer import Tokenizer


@dataclass
class DeltaReasoning:
    """What one streamed step adds: thinking, answer text, or both (None: nothing)."""

    reasoning: str | None = None
    content: str | None = None


class ReasoningParser:
    """Base class: a subclass defines `split(text)`, the whole split of a finished
    output, and `tags`, the markers whose partial forms a stream holds back.

    `chat_template_kwargs` is the request's (Qwen3 reads `enable_thinking`)."""

    #: The markers, opening one first; a stream holds back their partial forms.
    tags: tuple[str, ...] = ()
    #: The text that may open the output's thinking ("" when none is looked for).
    start_token: str = ""
    #: The text that ends the thinking (used by `is_reasoning_end` and the prompt check).
    end_token: str = ""

    def __init__(self, tokenizer: Tokenizer | None, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    # ------------------------------------------------------------------ the split

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is absent."""
        raise NotImplementedError

    def extract_reasoning(self, model_output: str, request: Any = None) -> tuple[str | None, str | None]:
        """vLLM's name for the whole split: (reasoning, content)."""
        return self.split(model_output)

    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
                                    delta_token_ids: Sequence[int] = (), *,
                                    finished: bool = False) -> DeltaReasoning | None:
        """What the text from ``previous_text`` to ``current_text`` adds to the split;
        None when it adds nothing yet. A tail that may be a tag's start is held back
        until the next call, or until ``finished`` (the output's last call) shows it."""
        before_reasoning, before_content = self._stream_split(previous_text, False)
        reasoning, content = self._stream_split(current_text, finished)
        delta = DeltaReasoning(reasoning[len(before_reasoning):] or None, content[len(before_content):] or None)
        return delta if delta.reasoning is not None or delta.content is not None else None

    def _stream_split(self, text: str, finished: bool) -> tuple[str, str]:
        if not finished:
            # An output that is so far blank, or the start of its opening tag, is undecided.
            if self.start_token and self.start_token.startswith(text.lstrip()):
                return "", ""
            text = text[:len(text) - held_tail(text, self.tags)]
        reasoning, content = self.split(text)
        return reasoning or "", content or ""

    # --------------------------------------------------------------- token checks

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether these ids (a prompt and its output so far) hold the end of the
        thinking after its last start (``tags[0]``): from then on the output is the
        answer. Decodes the ids, so a tag of several tokens counts too."""
        if self.tokenizer is None or not self.end_token:
            return False
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        end = text.rfind(self.end_token)
        return end >= 0 and end > (text.rfind(self.tags[0]) if self.tags else -1)

    def prompt_ends_reasoning(self, prompt_text: str) -> bool:
        """Whether a rendered prompt already closed the thinking (Qwen3's template with
        ``enable_thinking: false`` ends it with ``<think>\\n\\n</think>\\n\\n``): the output
        is then all answer."""
        return bool(self.end_token) and prompt_text.rstrip().endswith(self.end_token)

    def reasoning_end_token_ids(self) -> list[int]:
        """The ids of the end tag when it is one token of this tokenizer, else []: what
        the engine would watch for to start a grammar after the thinking."""
        if self.tokenizer is None or not self.end_token:
            return []
        token_id = self.tokenizer.token_to_id(self.end_token)
        return [token_id] if token_id is not None else []


class ReasoningParserManager:
    """Reasoning parsers by the name `--reasoning-parser` takes (vLLM's names)."""

    _registry: ClassVar[ParserRegistry[ReasoningParser]] = ParserRegistry("reasoning parser")
    reasoning_parsers = _registry.parsers
    register_module = _registry.register_module
    get_reasoning_parser = _registry.get
