"""Streamed completions send one chunk per output that brings tokens (vLLM's behaviour),
even while those tokens add no text: clients such as `vllm bench serve` time tokens by
chunk, so holding them back made TTFT look like the whole request and TPOT zero."""

from __future__ import annotations

from engine.entrypoints.openai.protocol import CompletionRequest
from engine.entrypoints.openai.serving_completion import PromptState, chunk_choice
from engine.entrypoints.openai.sse import ChoiceState
from engine.outputs import CompletionOutput, RequestOutput


def output(token_ids: list[int], text: str, finished: bool = False) -> RequestOutput:
    sample = CompletionOutput(0, text, token_ids, None, None, "length" if finished else None)
    return RequestOutput("r", [1], [sample], finished)


def test_every_output_with_new_tokens_is_a_chunk_even_without_new_text():
    body = CompletionRequest(prompt="x")
    state, prompt = ChoiceState(), PromptState([1], "")
    steps = [
        output([5], ""),  # a token with no text (say, a special token)
        output([5, 6], "\ufffd"),  # half of a two-byte character: held back
        output([5, 6, 7], "é"),  # the character completes
        output([5, 6, 7], "é"),  # the same output again: nothing new, no chunk
        output([5, 6, 7, 8], "é!", finished=True),
    ]
    sent = [chunk_choice(body, prompt, step, step.outputs[0], state, 0) for step in steps]
    assert [choice is not None for choice in sent] == [True, True, True, False, True]
    texts = [choice.text for choice in sent if choice is not None]
    assert texts == ["", "", "é", "!"] and "".join(texts) == "é!"
    assert [choice.finish_reason for choice in sent if choice is not None] == [None, None, None, "length"]


def test_an_echoed_prompt_comes_in_the_first_chunk_even_without_tokens():
    body = CompletionRequest(prompt="x", echo=True, max_tokens=0)
    state, prompt = ChoiceState(), PromptState([1, 2], "Hello")
    final = output([], "", finished=True)
    choice = chunk_choice(body, prompt, final, final.outputs[0], state, 0)
    assert choice is not None and choice.text == "Hello" and choice.finish_reason == "length"
    assert chunk_choice(body, prompt, final, final.outputs[0], state, 0) is None
