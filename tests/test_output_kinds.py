"""The three RequestOutputKinds, and detokenize=False, through a real in-process
EngineCore (TP=1, CPU, float32, a tiny llama with a tokenizer), driven by
``add_request`` and ``step()``:

* FINAL_ONLY gives exactly one output, the finished one, equal to CUMULATIVE's last
  (also with a stop string: same end, text and stop reason).
* DELTA gives only what is new on each output: the deltas' token ids, text and
  per-token logprobs concatenate to CUMULATIVE's final ones; the cumulative logprob
  stays a total; the prompt's logprobs come in the first output only; only the last
  output is finished; with n=2 each output holds just the samples that changed.
* detokenize=False gives the same token ids with empty text in every kind, and is
  refused together with stop strings; a non-enum ``output_kind`` is refused.
* ``generate()`` gives CUMULATIVE's final result and leaves the caller's
  ``output_kind`` as it was.

Greedy (temperature 0) everywhere except the n=2 test, which samples with a seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from config import RequestOutputKind, SamplingParams
from engine.core import EngineCore
from engine.outputs import CompletionOutput, RequestOutput
from tests.conftest import tiny_llama_with_tokenizer

PROMPT = "the quick brown fox jumps over the lazy dog and then"
MAX_TOKENS = 14
LOGPROB_TOLERANCE = 1e-5  # separate runs may prefill differently (prefix cache), so not bit for bit

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("output_kinds") / "tiny", num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                                     init_std=0.1)


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    core = EngineCore(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256,
                      num_gpu_blocks_override=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    yield core
    core.shutdown()


def _greedy(kind: RequestOutputKind = CUMULATIVE, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, output_kind=kind, **{"max_tokens": MAX_TOKENS, "ignore_eos": True, **kwargs})


def _run_all(engine: EngineCore, params: list[SamplingParams], prompt: str = PROMPT) -> list[list[RequestOutput]]:
    """Run one request per entry of ``params`` together, stepping until none is
    unfinished; every RequestOutput each one was given, in order."""
    ids = [engine.add_request(prompt, p) for p in params]
    seen: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    return [seen[i] for i in ids]


def _run(engine: EngineCore, params: SamplingParams, prompt: str = PROMPT) -> list[RequestOutput]:
    return _run_all(engine, [params], prompt)[0]


def _samples(outputs: list[RequestOutput], index: int) -> list[CompletionOutput]:
    """Sample ``index``'s part of each output that has one."""
    return [s for out in outputs for s in out.outputs if s.index == index]


def _joined(parts: list[CompletionOutput]) -> tuple[list[int], str]:
    return [t for p in parts for t in p.token_ids], "".join(p.text for p in parts)


def _assert_logprobs_close(ours: list[dict[int, float]], expected: list[dict[int, float]]) -> None:
    assert len(ours) == len(expected)
    for a, b in zip(ours, expected, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[k] - b[k]) < LOGPROB_TOLERANCE for k in a)


def test_final_only_and_delta_agree_with_cumulative(engine: EngineCore) -> None:
    cumulative, final_only, delta = _run_all(engine, [_greedy(CUMULATIVE), _greedy(FINAL_ONLY), _greedy(DELTA)])
    last = cumulative[-1]
    assert len(cumulative) == MAX_TOKENS and last.finished and len(last.token_ids) == MAX_TOKENS
    assert last.finish_reason == "length" and last.text
    assert [out.finished for out in cumulative] == [False] * (MAX_TOKENS - 1) + [True]

    assert len(final_only) == 1
    (final,) = final_only
    assert final.finished
    assert (final.text, final.token_ids, final.finish_reason) == (last.text, last.token_ids, last.finish_reason)

    assert len(delta) > 1
    assert all(len(out.outputs) == 1 and out.token_ids for out in delta)  # every delta has something new
    assert _joined(_samples(delta, 0)) == (last.token_ids, last.text)
    assert [out.finished for out in delta] == [False] * (len(delta) - 1) + [True]
    assert [out.finish_reason for out in delta] == [None] * (len(delta) - 1) + ["length"]


def test_delta_logprobs_and_prompt_logprobs(engine: EngineCore) -> None:
    extra: dict[str, Any] = {"logprobs": 2, "prompt_logprobs": 1}
    cumulative = _run(engine, _greedy(CUMULATIVE, **extra))
    delta = _run(engine, _greedy(DELTA, **extra))
    last = cumulative[-1]
    assert last.logprobs is not None and len(last.logprobs) == MAX_TOKENS
    assert _joined(_samples(delta, 0))[0] == last.token_ids

    parts = _samples(delta, 0)
    assert all(p.logprobs is not None and len(p.logprobs) == len(p.token_ids) for p in parts)
    _assert_logprobs_close([entry for p in parts for entry in p.logprobs], last.logprobs)
    # The cumulative logprob stays a total: of every token given so far, not of the delta's.
    total = 0.0
    for p in parts:
        total += sum(entry[token] for entry, token in zip(p.logprobs, p.token_ids, strict=True))
        assert p.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert abs(parts[-1].cumulative_logprob - last.outputs[0].cumulative_logprob) < LOGPROB_TOLERANCE * MAX_TOKENS

    assert last.prompt_logprobs is not None
    first = delta[0]
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(last.prompt_logprobs)
    assert first.prompt_logprobs[0] is None and last.prompt_logprobs[0] is None
    _assert_logprobs_close(first.prompt_logprobs[1:], last.prompt_logprobs[1:])
    assert first.prompt_logprob_ranks == last.prompt_logprob_ranks
    assert all(out.prompt_logprobs is None and out.prompt_logprob_ranks is None for out in delta[1:])


def test_delta_with_two_samples_gives_only_the_samples_that_changed(engine: EngineCore) -> None:
    sampled: dict[str, Any] = {"n": 2, "seed": 7, "temperature": 1.0, "max_tokens": 12, "ignore_eos": True}
    plain = _run(engine, SamplingParams(**sampled))[-1]
    first, second = (o.token_ids for o in plain.outputs)
    assert first != second
    # A token of sample 0 that sample 1 never makes: as a stop token it ends sample 0
    # early while sample 1 runs on, so later steps change only sample 1.
    stop_at = next(i for i in range(2, 8) if first[i] not in first[:i] and first[i] not in second)
    params = {**sampled, "stop_token_ids": [first[stop_at]]}

    cumulative = _run(engine, SamplingParams(output_kind=CUMULATIVE, **params))
    delta = _run(engine, SamplingParams(output_kind=DELTA, **params))
    final = cumulative[-1]
    assert final.outputs[0].token_ids == first[:stop_at + 1] and final.outputs[0].finish_reason == "stop"
    assert final.outputs[1].token_ids == second and final.outputs[1].finish_reason == "length"

    for index in (0, 1):
        parts = _samples(delta, index)
        assert _joined(parts) == (final.outputs[index].token_ids, final.outputs[index].text)
        assert all(p.token_ids for p in parts)
        assert [p.finish_reason is not None for p in parts] == [False] * (len(parts) - 1) + [True]
        assert parts[-1].finish_reason == final.outputs[index].finish_reason
        assert parts[-1].stop_reason == final.outputs[index].stop_reason
    # Step by step, a DELTA output holds exactly the samples whose cumulative state changed.
    assert len(delta) == len(cumulative)
    previous: list[CompletionOutput | None] = [None, None]
    for cum, dlt in zip(cumulative, delta, strict=True):
        changed = [s.index for s in cum.outputs if previous[s.index] != s]
        assert [s.index for s in dlt.outputs] == changed
        previous = list(cum.outputs)
    assert any(len(out.outputs) == 1 for out in delta)  # after sample 0 stopped
    assert delta[-1].finished and not any(out.finished for out in delta[:-1])


def test_final_only_with_a_stop_string_ends_where_cumulative_does(engine: EngineCore) -> None:
    text = _run(engine, _greedy(max_tokens=24))[-1].text
    middle = len(text) // 2
    stop = next(text[i:i + 3] for i in range(middle, len(text) - 3) if text[i:i + 3].strip())
    index = text.index(stop)

    cumulative = _run(engine, _greedy(CUMULATIVE, max_tokens=24, stop=[stop]))
    final_only = _run(engine, _greedy(FINAL_ONLY, max_tokens=24, stop=[stop]))
    last = cumulative[-1]
    assert last.text == text[:index] and last.finish_reason == "stop" and last.outputs[0].stop_reason == stop
    assert len(last.token_ids) < 24
    assert len(final_only) == 1 and final_only[0].finished
    (final,) = final_only
    assert (final.text, final.token_ids, final.finish_reason, final.outputs[0].stop_reason) == (
        last.text, last.token_ids, last.finish_reason, stop)


def test_detokenize_false_gives_token_ids_only(engine: EngineCore) -> None:
    reference = _run(engine, _greedy())[-1]
    assert reference.text
    for kind in RequestOutputKind:
        outputs = _run(engine, _greedy(kind, detokenize=False))
        assert outputs and outputs[-1].finished
        assert all(s.text == "" for out in outputs for s in out.outputs)
        token_ids = _joined(_samples(outputs, 0))[0] if kind is DELTA else outputs[-1].token_ids
        assert token_ids == reference.token_ids
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="DELTA")  # type: ignore[arg-type]


def test_generate_gives_the_final_output_and_leaves_the_callers_params(engine: EngineCore) -> None:
    params = _greedy()
    cumulative = _run(engine, params)
    generated = engine.generate([PROMPT, PROMPT], params)
    assert params.output_kind is CUMULATIVE
    assert len(generated) == 2
    for out in generated:
        assert out.finished
        assert (out.token_ids, out.text) == (cumulative[-1].token_ids, cumulative[-1].text)
    # The caller's params still give an output on every step.
    assert len(_run(engine, params)) == MAX_TOKENS
