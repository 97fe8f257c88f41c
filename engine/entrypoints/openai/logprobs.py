"""Logprobs in the two OpenAI shapes: completions (`tokens` / `token_logprobs` /
`top_logprobs` / `text_offset` lists) and chat (`content`: one entry per token).

Both take the generated tokens [start, end) of a cumulative `RequestOutput`, so a
stream sends each token's logprobs once. Without a tokenizer a token's text is
`token_id:N`. A position the engine has no logprobs for gets an empty top list.
"""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.entrypoints.openai.protocol import ChatChoiceLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogProbs
from engine.outputs import RequestOutput
from engine.tokenizer import Tokenizer


class TextOffsets:
    """Where each generated token starts in the completion text (OpenAI `text_offset`).

    One per response, asked for increasing positions: an incremental detokenizer makes
    that O(1) decodes per token, where decoding every prefix was quadratic in the
    response length. Text held back for an unfinished multi-byte character does not
    count yet, so no offset points inside a character.
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None

    def before(self, token_ids: list[int], i: int) -> int:
        if self._detokenizer is None or i == 0:
            return 0
        return len(self._detokenizer.update(token_ids[:i]))


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    """One token's text, special tokens included."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _entry(output: RequestOutput, i: int) -> dict[int, float]:
    return output.logprobs[i] if output.logprobs is not None and i < len(output.logprobs) else {}


def completion_logprobs(tokenizer: Tokenizer | None, output: RequestOutput, start: int, end: int,
                        offsets: TextOffsets) -> CompletionLogProbs:
    """Completions logprobs of generated tokens [start, end); text_offset is each token's
    start in the completion text, from `offsets` (one per response, asked for increasing
    token positions)."""
    result = CompletionLogProbs()
    ids = output.token_ids
    for i in range(start, end):
        entry = _entry(output, i)
        result.tokens.append(token_text(tokenizer, ids[i]))
        result.token_logprobs.append(entry.get(ids[i]))
        top: dict[str, float] = {}
        for t, lp in entry.items():  # distinct ids can share a text: keep the likeliest
            text = token_text(tokenizer, t)
            top[text] = max(lp, top.get(text, lp))
        result.top_logprobs.append(top)
        result.text_offset.append(offsets.before(ids, i))
    return result


def chat_logprobs(tokenizer: Tokenizer | None, output: RequestOutput, start: int, end: int,
                  top: int) -> ChatChoiceLogprobs:
    """Chat logprobs of generated tokens [start, end), each with its `top` likeliest."""
    content = []
    for i in range(start, end):
        token_id = output.token_ids[i]
        entry = _entry(output, i)
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        text = token_text(tokenizer, token_id)
        content.append(ChatTokenLogprob(
            token=text, logprob=entry.get(token_id, float("-inf")), bytes=list(text.encode()),
            top_logprobs=[ChatTopLogprob(token=(t := token_text(tokenizer, tid)), logprob=lp, bytes=list(t.encode()))
                          for tid, lp in best]))
    return ChatChoiceLogprobs(content=content)
