"""The reasoning formats of the families this server runs (vLLM's parser names):

* ``deepseek_r1``: DeepSeek-R1 and its distills (Qwen2 and Llama architectures). The
  template opens ``<think>`` in the prompt, so the output is thinking up to
  ``</think>``, then the answer; a ``<think>`` that opens the output is dropped, and an
  output with no ``</think>`` (cut by max_tokens) is all thinking.
* ``qwen3``: Qwen3 and Qwen3-MoE, the same split; with ``chat_template_kwargs:
  {"enable_thinking": false}`` the model does not think and the output is all answer.
* ``mistral``: Magistral (Mistral's reasoning models): thinking between ``[THINK]`` and
  ``[/THINK]``, the answer around it; an output with no ``[THINK]`` is all answer.
"""

from __future__ import annotations

from engine.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """Thinking first, up to ``</think>``; then the answer."""

    start_token = "<think>"
    end_token = "</think>"
    tags = ("<think>", "</think>")

    def split(self, text: str) -> tuple[str | None, str | None]:
        if text.lstrip().startswith(self.start_token):
            text = text.lstrip()[len(self.start_token):]
        reasoning, found, content = text.partition(self.end_token)
        if not found:
            return text, None
        return reasoning, content or None


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(DeepSeekR1ReasoningParser):
    """DeepSeek-R1's split, unless the request turned thinking off (then all answer)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.thinking_enabled = self.chat_template_kwargs.get("enable_thinking", True) is not False
        if not self.thinking_enabled:
            self.tags = ()
            self.start_token = ""

    def split(self, text: str) -> tuple[str | None, str | None]:
        if not self.thinking_enabled:
            return None, text
        return super().split(text)


@ReasoningParserManager.register_module("mistral")
class MistralReasoningParser(ReasoningParser):
    """Thinking between ``[THINK]`` and ``[/THINK]``; the answer is the text around it."""

    end_token = "[/THINK]"
    tags = ("[THINK]", "[/THINK]")
    _open = "[THINK]"

    def split(self, text: str) -> tuple[str | None, str | None]:
        before, found, rest = text.partition(self._open)
        if not found:
            return None, text
        reasoning, _, after = rest.partition(self.end_token)
        return reasoning, (before + after) or None
