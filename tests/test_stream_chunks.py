"""Streamed completions send one chunk per output that brings tokens (vLLM's behaviour),
even while those tokens add no text: clients such as `vllm bench serve` time tokens by
chunk, so holding them back made TTFT look like the whole request and TPOT zero."""

from __future__ import annotations

from engine.entrypoints.openai.protocol import CompletionChoice, CompletionResponse
from engine.entrypoints.openai.serving_completion import stream_chunks
from engine.entrypoints.openai.sse import StreamState
from engine.outputs import RequestOutput


def response(choices: list[CompletionChoice], output: RequestOutput | None) -> CompletionResponse:
    usage = None if output is None else {"prompt_tokens": 1, "completion_tokens": len(output.token_ids),
                                         "total_tokens": 1 + len(output.token_ids)}
    return CompletionResponse(id="cmpl-1", created=0, model="m", choices=choices, usage=usage)


def output(token_ids: list[int], text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [1], token_ids, text, None, finished, "length" if finished else None)


def test_every_output_with_new_tokens_is_a_chunk_even_without_new_text():
    state = StreamState()
    steps = [
        output([5], ""),  # a token with no text (say, a special token)
        output([5, 6], "\ufffd"),  # half of a two-byte character: held back
        output([5, 6, 7], "é"),  # the character completes
        output([5, 6, 7], "é"),  # the same output again: nothing new, no chunk
        output([5, 6, 7, 8], "é!", finished=True),
    ]
    sent = [stream_chunks(step, state, response, None, with_usage=True) for step in steps]
    assert [len(payloads) for payloads in sent] == [1, 1, 1, 0, 2]  # the last adds the usage chunk
    texts = [payloads[0]["choices"][0]["text"] for payloads in sent if payloads]
    assert texts == ["", "", "é", "!"] and "".join(texts) == "é!"
    finish = [payloads[0]["choices"][0]["finish_reason"] for payloads in sent if payloads]
    assert finish == [None, None, None, "length"]
    assert sent[-1][1]["choices"] == [] and sent[-1][1]["usage"]["completion_tokens"] == 4
