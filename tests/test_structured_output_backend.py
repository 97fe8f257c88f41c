"""The structured-output backend, manager and bitmask, without an engine: compiling each
constraint kind (and refusing bad ones naming the field), the compile cache, one matcher
per sample, keeping a matcher in line with a request's kept tokens, and the mask the
ranks apply (rows of unconstrained requests untouched, logprobs raw)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from config import SamplingParams, StructuredOutputsConfig, StructuredOutputsParams
from engine.structured_output import StructuredOutputManager, grammar_bitmask, step_grammar
from engine.structured_output.backend_xgrammar import choice_grammar, unsupported_schema_feature
from engine.tiny_model import EOS_ID, build_tokenizer
from engine.tokenizer import Tokenizer
from worker.grammar_bitmask import GrammarBitmask, apply_grammar_bitmask
from worker.outputs import ScheduledRequest
from worker.sampler import Sampler

VOCAB = 400  # the logits' width: past the tokenizer's 353 ids (a padded model vocab), not a multiple of 32


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer(512))


def make_manager(tokenizer: Tokenizer, **config: object) -> StructuredOutputManager:
    engine_config = SimpleNamespace(structured_outputs_config=StructuredOutputsConfig(**config),
                                    model_config=SimpleNamespace(vocab_size=VOCAB))
    return StructuredOutputManager(engine_config, tokenizer, [EOS_ID])


@pytest.fixture(scope="module")
def manager(tokenizer: Tokenizer) -> StructuredOutputManager:
    return make_manager(tokenizer)


def generate(manager: StructuredOutputManager, tokenizer: Tokenizer, constraint: dict, seed: int,
             max_tokens: int = 80) -> tuple[str, bool]:
    """Random allowed tokens until the grammar terminates: (text, terminated)."""
    request = manager.new_request(manager.compile(StructuredOutputsParams(**constraint)))
    gen = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(max_tokens):
        bitmask = request.backend.allocate_bitmask(1)
        request.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, manager.vocab_size, generator=gen)
        apply_grammar_bitmask(logits, GrammarBitmask([0], bitmask.numpy().tobytes()))
        token = int(logits.argmax())
        assert request.accept_token(token)
        if request.is_terminated():
            return tokenizer.decode(tokens), True
        tokens.append(token)
    return tokenizer.decode(tokens), False


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "ok": {"type": "boolean"}}, "required": ["name", "ok"]}


@pytest.mark.parametrize("seed", range(4))
def test_masked_random_tokens_always_match_the_constraint(manager, tokenizer, seed):
    jsonschema = pytest.importorskip("jsonschema")
    text, done = generate(manager, tokenizer, {"json": SCHEMA, "disable_any_whitespace": True}, seed)
    assert done
    # strict=False: xgrammar's JSON strings admit raw control characters (as in vLLM).
    jsonschema.validate(json.loads(text, strict=False), SCHEMA)
    text, done = generate(manager, tokenizer, {"regex": r"[a-c]{2}-\d{1,3}"}, seed)
    assert done and re.fullmatch(r"[a-c]{2}-\d{1,3}", text)
    text, done = generate(manager, tokenizer, {"choice": ["yes", "no", 'say "hi"\n']}, seed)
    assert done and text in ("yes", "no", 'say "hi"\n')
    text, done = generate(manager, tokenizer, {"grammar": 'root ::= "(" [0-9]+ ")"'}, seed)
    assert done and re.fullmatch(r"\(\d+\)", text)
    text, done = generate(manager, tokenizer, {"json_object": True, "disable_any_whitespace": True}, seed, 200)
    assert not done or isinstance(json.loads(text, strict=False), dict)


@pytest.mark.parametrize("constraint, field", [
    ({"json": {"type": "foo"}}, "structured_outputs.json"),
    ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json"),
    ({"json": {"$ref": "http://example.com/s.json"}}, "structured_outputs.json"),
    ({"regex": "(ab"}, "structured_outputs.regex"),
    ({"grammar": 'root ::= undefined_rule'}, "structured_outputs.grammar"),
    ({"grammar": 'start ::= "a"'}, "structured_outputs.grammar"),
    ({"structural_tag": "{not json"}, "structured_outputs.structural_tag"),
    ({"regex": "a", "whitespace_pattern": " *"}, "structured_outputs.whitespace_pattern"),
])
def test_a_constraint_that_does_not_compile_is_a_value_error_naming_its_field(manager, constraint, field):
    with pytest.raises(ValueError, match=f"^{re.escape(field)}"):
        manager.compile(StructuredOutputsParams(**constraint))


def test_each_constraint_compiles_once_and_the_cache_is_bounded(tokenizer):
    manager = make_manager(tokenizer)
    manager.cache_size = 2
    for _ in range(3):
        manager.compile(StructuredOutputsParams(regex="a+"))
        manager.compile(StructuredOutputsParams(json={"type": "integer"}))
    assert manager.num_compilations == 2
    manager.compile(StructuredOutputsParams(regex="b+"))  # evicts the least recently used, a+
    manager.compile(StructuredOutputsParams(json={"type": "integer"}))
    assert manager.num_compilations == 3
    manager.compile(StructuredOutputsParams(regex="a+"))
    assert manager.num_compilations == 4
    # Options are part of the key: the same schema without whitespace is another grammar.
    manager.compile(StructuredOutputsParams(json={"type": "integer"}, disable_any_whitespace=True))
    assert manager.num_compilations == 5


def test_samples_of_one_grammar_match_independently_and_sync_to_kept_tokens(manager, tokenizer):
    compiled = manager.compile(StructuredOutputsParams(choice=["abc", "xyz"]))
    first, second = manager.new_request(compiled), manager.new_request(compiled)
    a, x = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("x", add_special_tokens=False)
    assert first.accept_token(a[0]) and second.accept_token(x[0])
    assert not first.accept_token(x[0]) and first.num_accepted == 1
    # The engine kept only the prompt's worth of tokens (none): roll back, then re-take.
    first.sync([])
    assert first.num_accepted == 0 and first.accept_token(x[0])
    second.sync(x + tokenizer.encode("yz", add_special_tokens=False))
    assert second.accept_token(EOS_ID) and second.is_terminated()


def test_step_grammar_rows_follow_the_constrained_requests_in_order(manager):
    compiled = manager.compile(StructuredOutputsParams(regex="[0-9]"))
    request = manager.new_request(compiled)
    ids, data = step_grammar([("free", None), ("digit", request)])
    assert ids == ["digit"]
    words = torch.frombuffer(bytearray(data), dtype=torch.int32).view(1, -1)
    allowed = {t for t in range(manager.vocab_size) if (int(words[0, t // 32]) >> (t % 32)) & 1}
    assert allowed and all(manager.tokenizer.decode([t]).isdigit() for t in allowed)
    assert step_grammar([("free", None)]) == ([], None)
    assert grammar_bitmask([request]) == data


def test_sampler_masks_only_constrained_rows_and_keeps_raw_logprobs(manager):
    request = manager.new_request(manager.compile(StructuredOutputsParams(regex="[0-9]")))
    _, data = step_grammar([("c", request)])
    logits = torch.randn(3, manager.vocab_size, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.0, logprobs=1)
    reqs = [ScheduledRequest(f"r{i}", [1], 0, [0], True, params, 0) for i in range(3)]
    tokens, logprobs = Sampler()(logits.clone(), reqs, 0, GrammarBitmask([1], data))
    assert manager.tokenizer.decode([tokens[1]]).isdigit()
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    raw = torch.log_softmax(logits[1], dim=-1)
    assert logprobs[1][tokens[1]] == pytest.approx(float(raw[tokens[1]]), abs=1e-5)


def test_unsupported_schema_features_and_choice_escaping():
    assert unsupported_schema_feature({"properties": {"a": {"not": {"type": "string"}}}}) == "'not' at /properties/a"
    assert unsupported_schema_feature({"type": "array", "uniqueItems": False}) is None
    assert unsupported_schema_feature({"enum": [{"not": 1}]}) is None  # values, not schemas
    assert choice_grammar(['a"b', "é"]) == 'root ::= "a\\u0022b" | "\\u00e9"'


def test_special_tokens_and_ids_past_the_tokenizer_are_never_text(manager, tokenizer):
    """Detokenised text skips special tokens, so a grammar must not take "<s>" as text."""
    request = manager.new_request(manager.compile(StructuredOutputsParams(regex=".*")))
    bitmask = request.backend.allocate_bitmask(1)
    request.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, VOCAB)
    apply_grammar_bitmask(logits, GrammarBitmask([0], bitmask.numpy().tobytes()))
    allowed = set(torch.nonzero(~torch.isinf(logits[0])).flatten().tolist())
    assert EOS_ID in allowed and not allowed & {0, 1, 3}  # </s> ends it; <unk> <s> <pad> never appear
    assert not allowed & set(range(tokenizer.vocab_size, VOCAB)) and len(allowed) > 200


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_mask_applies_on_the_device_as_on_the_host(manager):
    requests = [manager.new_request(manager.compile(StructuredOutputsParams(regex=r"[0-9]+"))),
                manager.new_request(manager.compile(StructuredOutputsParams(choice=["abc", "xyz"])))]
    _, data = step_grammar([("a", requests[0]), ("free", None), ("b", requests[1])])
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    host, device = logits.clone(), logits.cuda()
    for rows in ([0, 2], [2, 0]):
        apply_grammar_bitmask(host, GrammarBitmask(rows, data))
        apply_grammar_bitmask(device, GrammarBitmask(rows, data))
        assert torch.equal(device.cpu(), host)
    assert torch.equal(host[1], logits[1])  # the free row is untouched


def test_structural_tags_in_vllms_legacy_form_constrain_the_tagged_part(manager, tokenizer):
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}], "triggers": ["<f>"]}
    compiled = manager.compile(StructuredOutputsParams(structural_tag=json.dumps(tag)))
    good, bad = manager.new_request(compiled), manager.new_request(compiled)
    assert all(good.accept_token(t) for t in tokenizer.encode("hi <f>42</f>", add_special_tokens=False))
    assert not all(bad.accept_token(t) for t in tokenizer.encode("hi <f>x", add_special_tokens=False))


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [3, 1], [2]])
def test_the_cpu_mask_equals_xgrammars_kernel(rows):
    """Our branch-free CPU path sets to -inf exactly what xgrammar's kernel does, for any
    rows of the step and a vocabulary that is not a multiple of 32."""
    xgrammar = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(len(rows))
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), (VOCAB + 31) // 32), dtype=torch.int32, generator=gen)
    words[0, :3] = 0  # whole words forbidden and allowed, beside random ones
    words[-1, 3:6] = -1
    logits = torch.randn(4, VOCAB, generator=gen)
    ours = logits.clone()
    apply_grammar_bitmask(ours, GrammarBitmask(rows, words.numpy().tobytes()))
    full = torch.full((4, words.shape[1]), -1, dtype=torch.int32)
    full[rows] = words
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, full, vocab_size=VOCAB)
    assert torch.equal(ours, theirs)


def test_a_grammar_after_reasoning_starts_at_the_end_of_thinking(manager, tokenizer):
    """With `reasoning_end_token_ids` (what the chat server sets for a reasoning parser)
    the thinking is free, every token allowed, and the grammar applies from the token
    after the end of thinking; a rollback into the thinking starts the grammar over."""
    end = tokenizer.encode("x", add_special_tokens=False)[0]
    params = StructuredOutputsParams(choice=["yes", "no"], reasoning_end_token_ids=[end])
    request = manager.new_request(manager.compile(params), params.reasoning_end_token_ids)
    thinking = tokenizer.encode("ab cd", add_special_tokens=False)
    for token in thinking:
        bitmask = request.backend.allocate_bitmask(1)
        request.fill_bitmask(bitmask, 0)
        assert bool((bitmask == -1).all())  # free while thinking
        assert request.accept_token(token) and not request.is_terminated()
    assert request.accept_token(end)
    bitmask = request.backend.allocate_bitmask(1)
    request.fill_bitmask(bitmask, 0)
    assert not bool((bitmask == -1).all())  # the grammar now
    answer = tokenizer.encode("yes", add_special_tokens=False)
    assert all(request.accept_token(t) for t in answer)
    assert request.accept_token(EOS_ID) and request.is_terminated()
    kept = [*thinking, end, *answer]
    request.sync(kept[:2])  # back into the thinking
    assert request.num_accepted == 2 and request.grammar_start is None
    request.sync(kept)
    assert request.grammar_start == len(thinking) + 1 and request.num_accepted == len(kept)
    assert not request.accept_token(tokenizer.encode("no", add_special_tokens=False)[0])  # the choice is made
    with pytest.raises(ValueError, match="reasoning_end_token_ids"):
        StructuredOutputsParams(regex="a", reasoning_end_token_ids=[])
