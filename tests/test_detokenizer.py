"""IncrementalDetokenizer gives, token by token, exactly the text of a full decode."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tiny_model import make_tiny_model
from engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world, this is a test of incremental decoding.",
    "Tabs\tand\nnewlines\n\n and  double  spaces.",
    "Unicode: naïve café — 東京 😀 done",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("detok"), "llama", vocab_size=1000)
    tok = Tokenizer.from_dir(model_dir)
    assert tok is not None
    return tok


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode_at_every_step(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    for n in range(1, len(ids) + 1):
        partial = detok.update(ids[:n], finished=n == len(ids))
        full = tokenizer.decode(ids[:n])
        # Held-back text is a strict prefix; nothing is ever taken back.
        assert full.startswith(partial) or full.rstrip("\ufffd").startswith(partial)
    assert detok.text == tokenizer.decode(ids)


def test_random_ids_including_specials_match_full_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))]
        detok = IncrementalDetokenizer(tokenizer)
        for n in range(1, len(ids) + 1):
            detok.update(ids[:n], finished=n == len(ids))
        assert detok.text == tokenizer.decode(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_text_offsets_are_prefix_lengths(tokenizer: Tokenizer, text: str) -> None:
    """The API's `text_offset`: each token's start in the completion text, computed
    incrementally, equals the length of the decoded prefix wherever that prefix ends on a
    whole character (inside a split character it is never past it)."""
    from engine.entrypoints.openai.logprobs import TextOffsets

    ids = tokenizer.encode(text, add_special_tokens=False)
    offsets = TextOffsets(tokenizer)
    found = [offsets.before(ids, i) for i in range(len(ids))]
    assert found[0] == 0 and found == sorted(found)
    for i, offset in enumerate(found):
        prefix = tokenizer.decode(ids[:i])
        if prefix.endswith("\ufffd"):
            assert offset <= len(prefix.rstrip("\ufffd"))
        else:
            assert offset == len(prefix), i
    assert TextOffsets(None).before(ids, 3) == 0  # no tokenizer: offsets are 0
