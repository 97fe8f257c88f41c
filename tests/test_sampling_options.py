"""Every sampling option of SamplingParams, through a real EngineCore, against
transformers' own logits processors where it has one (repetition penalty, min new
tokens, sequence bias, bad words, prefix-constrained allowed ids, min-p) and against
the definition otherwise (OpenAI's frequency and presence penalties).

One in-process engine (TP=1) runs most checks; one TP=2 engine checks that the
options that need the request's token history (penalties, bad words, prompt
logprobs) give the same result on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from config import SamplingParams
from engine.core import EngineCore
from engine.tiny_model import EOS_ID
from tests.conftest import tiny_llama_with_tokenizer

MAX_MODEL_LEN = 256
PROMPT = "the quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("sampling") / "tiny", num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                                     init_std=0.1)


def _engine(model_dir: Path, **overrides: Any) -> EngineCore:
    kwargs: dict[str, Any] = dict(model=str(model_dir), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
                                  num_gpu_blocks_override=256, block_size=4, max_num_seqs=8,
                                  max_num_batched_tokens=64)
    kwargs.update(overrides)
    return EngineCore(**kwargs)


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    core = _engine(model_dir)
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model


def _prompt_ids(engine: EngineCore) -> list[int]:
    return engine.tokenizer.encode(PROMPT)


def _hf_generate(hf: Any, prompt_ids: list[int], max_new: int, stop_at_eos: bool = False, **kwargs: Any) -> list[int]:
    """transformers' greedy generate; without `stop_at_eos` it never stops early."""
    eos = EOS_ID if stop_at_eos else None
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                      pad_token_id=0, **kwargs)
    return out[0, len(prompt_ids):].tolist()


def _greedy(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, **{"max_tokens": 12, "ignore_eos": True, **kwargs})


def test_repetition_penalty_matches_transformers(engine: EngineCore, hf: Any) -> None:
    ids = _prompt_ids(engine)
    plain = engine.generate(ids, _greedy())[0].token_ids
    for penalty in (1.5, 0.7):
        ours = engine.generate(ids, _greedy(repetition_penalty=penalty))[0].token_ids
        assert ours == _hf_generate(hf, ids, 12, repetition_penalty=penalty)
    assert engine.generate(ids, _greedy(repetition_penalty=3.0))[0].token_ids != plain


class _OpenAIPenalties:
    """The definition: logit -= frequency * count + presence * (count > 0), over output tokens."""

    def __init__(self, num_prompt: int, frequency: float, presence: float) -> None:
        self.num_prompt, self.frequency, self.presence = num_prompt, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        outputs = input_ids[0, self.num_prompt:]
        counts = torch.bincount(outputs, minlength=scores.shape[-1]).to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.mark.parametrize("frequency,presence", [(1.5, 0.0), (0.0, 2.0), (0.8, -0.5)])
def test_frequency_and_presence_penalties_follow_the_openai_definition(
    engine: EngineCore, hf: Any, frequency: float, presence: float
) -> None:
    from transformers import LogitsProcessorList

    ids = _prompt_ids(engine)
    ours = engine.generate(ids, _greedy(frequency_penalty=frequency, presence_penalty=presence))[0].token_ids
    oracle = LogitsProcessorList([_OpenAIPenalties(len(ids), frequency, presence)])
    assert ours == _hf_generate(hf, ids, 12, logits_processor=oracle)


def test_min_tokens_holds_eos_back_until_reached(engine: EngineCore, hf: Any) -> None:
    ids = _prompt_ids(engine)
    bias = {EOS_ID: 100.0}  # EOS is the argmax at every step
    assert engine.generate(ids, SamplingParams(temperature=0, max_tokens=20, logit_bias=bias))[0].token_ids == [EOS_ID]
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=20, logit_bias=bias, min_tokens=6))[0]
    assert len(out.token_ids) == 7 and out.token_ids[-1] == EOS_ID and EOS_ID not in out.token_ids[:-1]
    assert out.finish_reason == "stop"
    oracle = _hf_generate(hf, ids, 20, stop_at_eos=True, min_new_tokens=6, sequence_bias={(EOS_ID,): 100.0})
    assert out.token_ids == oracle
    # stop_token_ids are held back too.
    stop_token = out.token_ids[2]
    held = engine.generate(ids, _greedy(stop_token_ids=[stop_token], min_tokens=4, max_tokens=8))[0]
    assert stop_token not in held.token_ids[:4]


def test_logit_bias_matches_transformers_sequence_bias(engine: EngineCore, hf: Any) -> None:
    ids = _prompt_ids(engine)
    plain = engine.generate(ids, _greedy())[0].token_ids
    bias = {plain[0]: -100.0, 77: 5.0, 300: 3.5}
    ours = engine.generate(ids, _greedy(logit_bias=bias))[0].token_ids
    assert ours != plain
    assert ours == _hf_generate(hf, ids, 12, sequence_bias={(t,): v for t, v in bias.items()})


def test_allowed_token_ids_match_a_prefix_constraint(engine: EngineCore, hf: Any) -> None:
    ids = _prompt_ids(engine)
    allowed = list(range(100, 140))
    ours = engine.generate(ids, _greedy(allowed_token_ids=allowed))[0].token_ids
    assert set(ours) <= set(allowed)
    assert ours == _hf_generate(hf, ids, 12, prefix_allowed_tokens_fn=lambda batch, tokens: allowed)
    sampled = engine.generate(ids, SamplingParams(max_tokens=30, ignore_eos=True, seed=3, allowed_token_ids=[5, 9]))
    assert set(sampled[0].token_ids) <= {5, 9}


def test_bad_words_match_transformers(engine: EngineCore, hf: Any) -> None:
    tokenizer = engine.tokenizer
    ids = _prompt_ids(engine)
    plain = engine.generate(ids, _greedy(max_tokens=16))[0]
    words = [tokenizer.decode(plain.token_ids[i:i + 2]).strip() for i in (0, 5)]
    words = [w for w in words if w]
    assert words
    out = engine.generate(ids, _greedy(max_tokens=16, bad_words=words))[0]
    bad_ids = [tokenizer.encode(t, add_special_tokens=False) for w in words for t in (w, " " + w)]
    tokens = ids + out.token_ids
    for bad in bad_ids:  # no bad word's token sequence ends at a generated token
        assert not any(tokens[end - len(bad):end] == bad for end in range(len(ids) + 1, len(tokens) + 1))
    assert out.token_ids != plain.token_ids
    assert out.token_ids == _hf_generate(hf, ids, 16, bad_words_ids=bad_ids)


def test_min_p_drops_unlikely_tokens(engine: EngineCore) -> None:
    ids = _prompt_ids(engine)
    greedy = engine.generate(ids, _greedy(max_tokens=16))[0].token_ids
    # Only tokens within 0.999 of the likeliest survive: sampling is greedy in all but ties.
    strict = SamplingParams(max_tokens=16, ignore_eos=True, seed=11, temperature=1.0, min_p=0.999)
    assert engine.generate(ids, strict)[0].token_ids == greedy
    loose = SamplingParams(max_tokens=16, ignore_eos=True, seed=11, temperature=1.5)
    assert engine.generate(ids, loose)[0].token_ids != greedy


def test_prompt_logprobs_match_transformers_log_softmax(engine: EngineCore, hf: Any) -> None:
    ids = _prompt_ids(engine)
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    # max_tokens=0 scores the prompt only, as log-likelihood evaluation asks.
    for max_tokens in (0, 3):
        out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=2))[0]
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
        assert out.prompt_logprobs[0] is None
        for pos in range(1, len(ids)):
            entry = out.prompt_logprobs[pos]
            row = expected[pos - 1]
            assert abs(entry[ids[pos]] - row[ids[pos]].item()) < 1e-4
            top = torch.topk(row, 2).indices.tolist()
            assert set(top) <= set(entry) and len(entry) <= 3
            assert out.prompt_logprob_ranks[pos] == int((row > row[ids[pos]]).sum()) + 1
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_prompt_logprobs_survive_chunked_prefill_and_a_warm_prefix_cache(engine: EngineCore) -> None:
    long_ids = (_prompt_ids(engine) * 8)[:150]  # > max_num_batched_tokens: three chunks
    first = engine.generate(long_ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    again = engine.generate(long_ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert len(first.prompt_logprobs) == len(long_ids)
    assert first.prompt_logprobs == again.prompt_logprobs  # the cached prefix was recomputed, not skipped


def _greedy_text(engine: EngineCore, ids: list[int], max_tokens: int = 24) -> tuple[str, list[int]]:
    out = engine.generate(ids, _greedy(max_tokens=max_tokens))[0]
    return out.text, out.token_ids


def test_stop_strings_spanning_token_boundaries(engine: EngineCore) -> None:
    ids = _prompt_ids(engine)
    text, token_ids = _greedy_text(engine, ids)
    tokenizer = engine.tokenizer
    # A stop string made of the end of one token's text and the start of the next one's.
    boundary = len(tokenizer.decode(token_ids[:4]))
    stop = text[boundary - 2: boundary + 2]
    assert len(stop) == 4 and stop.strip()
    index = text.index(stop)
    out = engine.generate(ids, _greedy(max_tokens=24, stop=[stop]))[0]
    assert out.text == text[:index] and out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    kept = engine.generate(ids, _greedy(max_tokens=24, stop=["never-there", stop],
                                        include_stop_str_in_output=True))[0]
    assert kept.text == text[:index + len(stop)]
    assert len(out.token_ids) < len(token_ids)


def test_stop_strings_are_held_back_while_running(engine: EngineCore) -> None:
    """The cumulative text of each step never shrinks and never shows the start of a
    stop string that completes later."""
    ids = _prompt_ids(engine)
    text, _ = _greedy_text(engine, ids)
    stop = text[10:16]
    params = _greedy(max_tokens=24, stop=[stop])
    request_id = engine.add_request(ids, params)
    seen: list[str] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == request_id
            seen.append(output.text)
    assert seen[-1] == text[:text.index(stop)]
    for before, after in zip(seen, seen[1:]):
        assert after.startswith(before)
    assert all(len(s) <= text.index(stop) for s in seen)


def test_n_samples_are_distinct_reproducible_and_share_the_prompt_blocks(model_dir: Path) -> None:
    core = _engine(model_dir, enable_prefix_caching=False)
    try:
        ids = core.tokenizer.encode(PROMPT * 3)
        params = SamplingParams(n=3, seed=5, max_tokens=8, ignore_eos=True, temperature=1.0)
        first = core.generate(ids, params)[0]
        assert [o.index for o in first.outputs] == [0, 1, 2]
        samples = [tuple(o.token_ids) for o in first.outputs]
        assert len(set(samples)) == 3
        assert [tuple(o.token_ids) for o in core.generate(ids, params)[0].outputs] == samples
        # Sample i is the request with seed + i.
        alone = core.generate(ids, SamplingParams(seed=6, max_tokens=8, ignore_eos=True))[0]
        assert tuple(alone.token_ids) == samples[1]

        def blocks_after_prefill(submit: Any) -> int:
            submit()
            while not all(r.num_output_tokens for r in core.scheduler.requests.values()):
                core.step()  # until every sample has its prompt in the cache
            used = core.scheduler.block_manager.num_blocks - core.scheduler.block_manager.num_free_blocks
            for request_id in list(core.output_processor.parents):
                core.abort_request(request_id)
            return used

        shared = blocks_after_prefill(lambda: core.add_request(ids, params))
        separate = blocks_after_prefill(lambda: [core.add_request(ids, SamplingParams(seed=s, max_tokens=8))
                                                 for s in range(3)])
        assert shared < separate
        assert core.scheduler.block_manager.num_free_blocks == core.scheduler.block_manager.num_blocks
    finally:
        core.shutdown()


def test_best_of_keeps_the_likeliest_samples(engine: EngineCore) -> None:
    ids = _prompt_ids(engine)
    every = engine.generate(ids, SamplingParams(n=4, seed=2, max_tokens=6, ignore_eos=True, logprobs=0))[0]
    best = max(every.outputs, key=lambda o: o.cumulative_logprob)
    picked = engine.generate(ids, SamplingParams(n=1, best_of=4, seed=2, max_tokens=6, ignore_eos=True))[0]
    assert len(picked.outputs) == 1 and picked.token_ids == best.token_ids
    assert picked.logprobs is None  # computed to rank the samples, not asked for
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    for fan_out in (dict(n=9), dict(best_of=9)):  # more than max_num_seqs=8 could never run in one step
        with pytest.raises(ValueError, match=f"{next(iter(fan_out))} must be at most max_num_seqs=8"):
            engine.add_request(ids, SamplingParams(**fan_out))
    assert not engine.has_unfinished_requests()


def test_truncate_prompt_tokens_and_skip_special_tokens(engine: EngineCore) -> None:
    ids = _prompt_ids(engine)
    tail = engine.generate(ids[-5:], _greedy(max_tokens=4))[0].token_ids
    assert engine.generate(ids, _greedy(max_tokens=4, truncate_prompt_tokens=5))[0].token_ids == tail
    head = engine.generate(ids[:5], _greedy(max_tokens=4))[0].token_ids
    right = _greedy(max_tokens=4, truncate_prompt_tokens=5, truncation_side="right")
    assert engine.generate(ids, right)[0].token_ids == head
    eos_text = engine.tokenizer.decode([EOS_ID], skip_special_tokens=False)
    forced = dict(max_tokens=3, logit_bias={EOS_ID: 100.0})
    assert engine.generate(ids, _greedy(**forced))[0].text == ""
    assert engine.generate(ids, _greedy(skip_special_tokens=False, **forced))[0].text == eos_text * 3


@pytest.mark.slow
def test_options_that_need_the_token_history_agree_across_tp_ranks(model_dir: Path, engine: EngineCore) -> None:
    ids = _prompt_ids(engine)
    params = [
        _greedy(repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3),
        _greedy(bad_words=[engine.tokenizer.decode(engine.generate(ids, _greedy())[0].token_ids[1:3]).strip()]),
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
    ]
    single = engine.generate([ids] * len(params), params)
    core = _engine(model_dir, tensor_parallel_size=2)
    try:
        double = core.generate([ids] * len(params), params)
    finally:
        core.shutdown()
    for a, b in zip(single, double):
        assert a.token_ids == b.token_ids
    for a, b in zip(single[2].prompt_logprobs[1:], double[2].prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_cache_salt_keeps_prefix_cache_hits_within_a_tenant(engine: EngineCore) -> None:
    ids = engine.tokenizer.encode(PROMPT * 4)
    stats = engine.scheduler.block_manager.stats
    engine.reset_prefix_cache()  # earlier tests cached prompts that start the same way

    def hits_of(salt: str | None) -> int:
        before = stats.hits
        request_id = engine.add_request(ids, _greedy(max_tokens=1), cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        assert request_id not in engine.output_processor.parents
        return stats.hits - before

    hits_of("tenant-a")
    assert hits_of("tenant-b") == 0  # another tenant's blocks are not found
    assert hits_of("tenant-a") > 0 and hits_of(None) == 0 and hits_of(None) > 0
