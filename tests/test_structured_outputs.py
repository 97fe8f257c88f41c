"""Structured outputs end to end: a random-weight tiny llama (whose unmasked output is
junk) must produce output that matches each request's JSON schema, regex, choice or
grammar, greedy and sampled, at TP 1 (uni) and TP 2 (mp, async scheduling), with n /
best_of, beside free requests, under prefix caching, preemption and multi-step decode;
bad constraints are ValueErrors naming the field and the engine goes on."""

from __future__ import annotations

import json
import logging
import re

import pytest

from config import SamplingParams
from engine.core import EngineCore
from tests.runtime_helpers import engine_config

pytestmark = pytest.mark.slow

# ASCII names: a random model's byte-level tokens can make invalid UTF-8 inside a JSON
# string, which xgrammar admits byte by byte and the text shows as U+FFFD.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"]}
REGEX = r"[a-e]{2,4}-\d{2}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "(" digit digit? digit? ")" \ndigit ::= [0-9]'
PROMPTS = ["Hello, world!", "The capital of France", "numbers 0 1 2", "Once upon a time", "def main():",
           "What is", "A tiny language model", "User: Can you help me?"]


def constraints() -> list[tuple[dict, object]]:
    """(structured_outputs, a check of the text) for each kind."""
    jsonschema = pytest.importorskip("jsonschema")

    def valid_json(text: str) -> bool:  # strict=False: xgrammar admits raw control characters in strings
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
        return True

    # Every kind but json_object is bounded, well inside the tests' max_tokens.
    return [({"json": SCHEMA, "disable_any_whitespace": True}, valid_json),
            ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) is not None),
            ({"choice": CHOICES}, lambda text: text in CHOICES),
            ({"grammar": GRAMMAR}, lambda text: re.fullmatch(r"\(\d{1,3}\)", text) is not None),
            ({"json_object": True, "disable_any_whitespace": True},
             lambda text: isinstance(json.loads(text, strict=False), dict))]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1-uni", "tp2-mp-async"])
def core(request, serve_model):
    backend = "uni" if request.param == 1 else "mp"
    with EngineCore(engine_config(serve_model, tp=request.param, distributed_executor_backend=backend)) as engine:
        assert engine.async_scheduling == (backend == "mp")
        yield engine


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_matches_its_constraint(core, temperature):
    checks = constraints()
    prompts, params, kinds = [], [], []
    for i, prompt in enumerate(PROMPTS):
        for constraint, check in checks:
            prompts.append(prompt)
            params.append(SamplingParams(max_tokens=48, temperature=temperature, seed=i,
                                         structured_outputs=constraint))
            kinds.append(check)
    outputs = core.generate(prompts, params)
    stopped = 0
    for output, check, param in zip(outputs, kinds, params):
        sample = output.outputs[0]
        if sample.finish_reason == "stop":
            stopped += 1
            assert check(sample.text), (param.structured_outputs, sample.text)
        else:  # an object may go on for ever; every other kind is bounded
            assert param.structured_outputs.json_object and sample.finish_reason == "length", sample
    assert stopped >= len(outputs) * 3 // 4


def test_samples_of_n_and_best_of_each_match(core):
    params = [SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=3, structured_outputs={"regex": REGEX}),
              SamplingParams(n=1, best_of=3, max_tokens=24, temperature=1.0, seed=4,
                             structured_outputs={"choice": CHOICES}, logprobs=0)]
    regex_out, choice_out = core.generate(["Hello", "What is"], params)
    assert len(regex_out.outputs) == 3 and len(choice_out.outputs) == 1
    assert all(re.fullmatch(REGEX, s.text) for s in regex_out.outputs)
    assert choice_out.outputs[0].text in CHOICES


def test_free_requests_in_a_mixed_batch_are_untouched(core):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = core.generate(["Once upon a time"], free)[0].outputs[0].token_ids
    mixed = core.generate(["Once upon a time", "Hello", "What is"],
                          [free, SamplingParams(max_tokens=24, temperature=0.0, structured_outputs={"regex": REGEX}),
                           SamplingParams(max_tokens=24, temperature=1.0, structured_outputs={"choice": CHOICES})])
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch(REGEX, mixed[1].outputs[0].text) and mixed[2].outputs[0].text in CHOICES


def test_prefix_cached_prompts_give_the_same_constrained_output(core):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # several full blocks to reuse
    params = SamplingParams(max_tokens=24, temperature=0.0, structured_outputs={"grammar": GRAMMAR})
    first = core.generate([prompt], params)[0].outputs[0]
    second = core.generate([prompt], params)[0].outputs[0]
    assert re.fullmatch(r"\(\d{1,3}\)", first.text) and second.token_ids == first.token_ids


def test_max_tokens_ends_a_constrained_request_with_length(core):
    params = SamplingParams(max_tokens=3, temperature=0.0, structured_outputs={"json": SCHEMA})
    sample = core.generate(["Hello"], params)[0].outputs[0]
    assert sample.finish_reason == "length" and len(sample.token_ids) == 3 and sample.text.startswith("{")


@pytest.mark.parametrize("constraint, field", [
    ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
    ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json"),
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"grammar": "root ::= missing"}, "structured_outputs.grammar"),
])
def test_bad_constraints_are_refused_naming_the_field_and_the_engine_goes_on(core, constraint, field):
    with pytest.raises(ValueError, match=f"^{re.escape(field)}"):
        core.add_request("Hello", SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert not core.has_unfinished_requests()
    answer = core.generate(["Hello"], SamplingParams(max_tokens=2, ignore_eos=True))[0]  # EOS is sampled at times
    assert answer.outputs[0].finish_reason == "length"


def test_schemas_given_as_python_values_reach_every_rank(core):
    """A schema of True (anything), or with int keys, is sent to the ranks as JSON: the
    step's typed wire format would not decode it as given."""
    params = [SamplingParams(max_tokens=6, temperature=0.0, structured_outputs={"json": True}),
              SamplingParams(max_tokens=6, temperature=0.0, structured_outputs={"json": {
                  "type": "object", "properties": {1: {"type": "integer"}}, "required": ["1"]}})]
    outputs = core.generate(["Hello", "What is"], params)
    assert outputs[1].outputs[0].text.startswith('{"1"')
    with pytest.raises(ValueError, match="^structured_outputs.json is not a JSON schema"):
        core.add_request("Hello", SamplingParams(structured_outputs={"json": {"enum": {1, 2}}}))


def test_a_repeated_constraint_is_compiled_once(core):
    schema = {"type": "object", "properties": {"only_here": {"type": "boolean"}}, "required": ["only_here"]}
    before = core.structured_output_manager.num_compilations
    params = SamplingParams(max_tokens=16, temperature=1.0, structured_outputs={"json": schema})
    outputs = core.generate(PROMPTS[:4], params)
    assert core.structured_output_manager.num_compilations == before + 1
    assert all(json.loads(o.outputs[0].text) in ({"only_here": True}, {"only_here": False})
               for o in outputs if o.outputs[0].finish_reason == "stop")


def test_preempted_and_multi_step_constrained_requests_stay_valid(serve_model, caplog):
    """A KV cache too small for the batch preempts requests mid-output; multi-step decode
    runs constrained batches one step at a time (and says so once)."""
    config = engine_config(serve_model, distributed_executor_backend="uni", num_gpu_blocks_override=10,
                           block_size=16, num_scheduler_steps=4)
    with caplog.at_level(logging.INFO, logger="engine.scheduler"), EngineCore(config) as core:
        preemptions = []
        preempt = core.scheduler._preempt
        core.scheduler._preempt = lambda request: (preemptions.append(request.request_id), preempt(request))[1]
        # Words only (or EOS, once a word exists): requests grow past what the cache holds.
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=7, structured_outputs={"regex": "[a-z ]+"})
        outputs = core.generate([p + " and more words to fill the cache" for p in PROMPTS[:6]], params)
        free = core.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert preemptions, "the small cache was meant to preempt"
    for output in outputs:
        sample = output.outputs[0]
        assert re.fullmatch("[a-z ]+", sample.text), sample.text
        assert sample.finish_reason == "length" and len(sample.token_ids) == 40 or sample.finish_reason == "stop"
    assert len(free.outputs[0].token_ids) >= 1
    assert sum("one step per scheduler output" in r.message for r in caplog.records) == 1


@pytest.mark.timeout(240)
def test_a_replaced_worker_group_resumes_constrained_requests_from_their_tokens(serve_model, tmp_path):
    """A rank killed mid-generation: the group is replaced, the requests re-run from their
    kept tokens with their matchers where those tokens left them; greedy output equals
    an undisturbed run."""
    import os
    import signal

    from tests.reliability.helpers import arm_forward_fault, wait_for_marker
    from tests.reliability.test_faults import _in_thread
    from tests.runtime_helpers import worker_pids

    prompts = PROMPTS[:3]
    params = [SamplingParams(max_tokens=32, temperature=0.0, structured_outputs={"regex": "[a-z ]{5,30}"}),
              SamplingParams(max_tokens=32, temperature=0.0, structured_outputs={"json": SCHEMA,
                                                                                "disable_any_whitespace": True}),
              SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)]
    config = engine_config(serve_model, tp=2, max_worker_restarts=1)  # the SIGKILL is seen at once
    with EngineCore(config) as core:
        reference = [o.outputs[0].token_ids for o in core.generate(prompts, params)]
        marker = tmp_path / "fault"
        core.collective_rpc(arm_forward_fault, args=(1, "hang", 6, str(marker)))  # a few decode steps in
        thread, out = _in_thread(lambda: core.generate(prompts, params))
        wait_for_marker(marker)
        os.kill(worker_pids(core)[1], signal.SIGKILL)
        thread.join(timeout=120)
        assert "error" not in out, repr(out.get("error"))
        assert core.num_worker_restarts == 1
        assert [o.outputs[0].token_ids for o in out["result"]] == reference
