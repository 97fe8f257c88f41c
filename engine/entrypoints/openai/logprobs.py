"""Logprobs in the API's shapes: completions (`tokens` / `token_logprobs` /
`top_logprobs` / `text_offset` lists, echoed prompt tokens first), chat (`content`: one
entry per token), and vLLM's `prompt_logprobs` (per prompt token: id -> logprob, rank,
decoded token).

The completions and chat helpers take tokens [start, end) of a cumulative sample, so
a stream sends each token's logprobs once. Without a tokenizer, or with
`return_tokens_as_token_ids`, a token's text is `token_id:N`. A position the engine
has no logprobs for gets an empty top list.
"""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogProbs,
    Logprob,
    PromptLogprobs,
)
from engine.tokenizer import Tokenizer


class TextOffsets:
    """Where each token starts in a choice's text (OpenAI `text_offset`).

    One per choice, asked for increasing positions of one growing token list (an
    echoed prompt's tokens first): an incremental detokenizer makes that O(1) decodes
    per token, where decoding every prefix was quadratic in the response length. Text
    held back for an unfinished multi-byte character does not count yet, so no
    offset points inside a character.
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None

    def before(self, token_ids: list[int], i: int) -> int:
        if self._detokenizer is None or i == 0:
            return 0
        return len(self._detokenizer.update(token_ids[:i]))


class TokenText:
    """A token's text as the API shows it: special tokens included, or `token_id:N`."""

    def __init__(self, tokenizer: Tokenizer | None, as_ids: bool = False) -> None:
        self.tokenizer = None if as_ids else tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(text_of: TokenText, token_ids: list[int], entries: list[dict[int, float] | None],
                        start: int, end: int, offsets: TextOffsets) -> CompletionLogProbs:
    """Completions logprobs of tokens [start, end) of `token_ids`; `entries[i]` holds
    token i's top logprobs (None: a first prompt token, which has none); text_offset
    is each token's start in the choice text, from `offsets`."""
    result = CompletionLogProbs()
    for i in range(start, end):
        entry = entries[i] if i < len(entries) else {}
        result.tokens.append(text_of(token_ids[i]))
        result.text_offset.append(offsets.before(token_ids, i))
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(entry.get(token_ids[i]))
        top: dict[str, float] = {}
        for t, lp in entry.items():  # distinct ids can share a text: keep the likeliest
            text = text_of(t)
            top[text] = max(lp, top.get(text, lp))
        result.top_logprobs.append(top)
    return result


def chat_logprobs(text_of: TokenText, token_ids: list[int], entries: list[dict[int, float]] | None,
                  start: int, end: int, top: int) -> ChatChoiceLogprobs:
    """Chat logprobs of generated tokens [start, end), each with its `top` likeliest."""
    content = []
    for i in range(start, end):
        token_id = token_ids[i]
        entry = entries[i] if entries is not None and i < len(entries) else {}
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        text = text_of(token_id)
        content.append(ChatTokenLogprob(
            token=text, logprob=entry.get(token_id, float("-inf")), bytes=list(text.encode()),
            top_logprobs=[ChatTopLogprob(token=(t := text_of(tid)), logprob=lp, bytes=list(t.encode()))
                          for tid, lp in best]))
    return ChatChoiceLogprobs(content=content)


def vllm_prompt_logprobs(text_of: TokenText, prompt_ids: list[int], entries: list[dict[int, float] | None],
                         ranks: list[int | None]) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: None for the first token, then for each prompt token its
    own logprob and the top ones, keyed by token id, with ranks (1 = likeliest)."""
    result: PromptLogprobs = []
    for i, entry in enumerate(entries):
        if entry is None:
            result.append(None)
            continue
        ordered = sorted(entry.items(), key=lambda kv: -kv[1])
        shown: dict[str, Logprob] = {}
        for place, (token_id, lp) in enumerate(ordered, start=1):
            rank = ranks[i] if token_id == prompt_ids[i] else place
            shown[str(token_id)] = Logprob(logprob=lp, rank=rank, decoded_token=text_of(token_id))
        result.append(shown)
    return result
