"""End-to-end generation through EngineCore, checked against transformers.

Greedy token ids and logprobs must equal transformers' `generate` for llama, qwen2 and
mistral at TP 1, 2 and 4 (including TP > kv heads), for batches of prompts of different
lengths that span many KV blocks and are prefilled in chunks. Preemption under a tiny KV
budget must not change the tokens; seeded sampling must be reproducible across runs and
TP sizes; string prompts must round-trip through the tokenizer.

Spawned engines are expensive on a small CPU host, so one module-scoped engine per
(model, tp) runs every check for that configuration; pytest orders the tests so each
engine starts once and is shut down before the next one starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest
import torch

from config import EngineConfig, SamplingParams
from engine.arg_utils import create_engine_config
from engine.core import EngineCore

MAX_NEW = 10
MAX_MODEL_LEN = 128
MAX_BATCHED = 32  # < the longest prompt: long prompts are prefilled in several chunks
PROMPT_LENS = (1, 7, 23, 40, 61)  # one token, partial blocks, and prompts over many blocks
LOGPROBS_ATOL = 1e-4

# (model, tp, block_size). TP=4 on "llama" (4 heads / 2 kv heads) and "llama_h8_kv2"
# (8 heads / 2 kv heads) replicates each kv head on two ranks; mistral_v333 has 1 kv head.
ENGINES = [
    ("llama", 1, 4),
    ("qwen2", 1, 4),
    ("mistral", 1, 16),
    ("llama", 2, 16),
    ("qwen2", 2, 4),
    ("mistral_v333", 2, 4),
    ("llama", 4, 4),
    ("llama_h8_kv2", 4, 16),
]


def make_prompts(vocab_size: int, seed: int = 0, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Avoid the special ids 0..3 so prompts look like text (eos is 2).
    return [torch.randint(4, vocab_size, (n,), generator=gen).tolist() for n in lens]


def engine_config(model_dir: Path, tp: int, block_size: int, **overrides: Any) -> EngineConfig:
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        tensor_parallel_size=tp,
        device="cpu",
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_BATCHED,
        block_size=block_size,
    )
    kwargs.update(overrides)
    return create_engine_config(**kwargs)


# ---------------------------------------------------------------------- the oracle


def _hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.eval()
    # Never stop at eos, so the lengths match SamplingParams(ignore_eos=True).
    hf.generation_config.eos_token_id = None
    hf.config.eos_token_id = None
    return hf


def hf_greedy(hf: Any, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """(token ids, log_softmax of the raw logits [max_new, vocab]) of one unpadded prompt."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == max_new, "transformers stopped early; eos was not disabled"
    logprobs = torch.log_softmax(torch.cat(out.logits, dim=0).float(), dim=-1)
    return tokens, logprobs


@pytest.fixture(scope="module")
def hf_reference(tiny_models: dict[str, Path]) -> Callable[[str], list[tuple[list[int], torch.Tensor]]]:
    """hf_reference(name) -> per prompt of make_prompts: (greedy ids, logprobs), cached."""
    cache: dict[str, list[tuple[list[int], torch.Tensor]]] = {}

    def get(name: str) -> list[tuple[list[int], torch.Tensor]]:
        if name not in cache:
            hf = _hf_model(tiny_models[name])
            cache[name] = [hf_greedy(hf, p, MAX_NEW) for p in make_prompts(hf.config.vocab_size)]
            del hf
        return cache[name]

    return get


# ---------------------------------------------------------------------- engines


class Engine(NamedTuple):
    name: str  # the tiny_models key
    core: EngineCore

    @property
    def vocab_size(self) -> int:
        return self.core.config.model_config.vocab_size


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{m}-tp{tp}-bs{bs}" for m, tp, bs in ENGINES])
def engine(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> Any:
    name, tp, block_size = request.param
    with EngineCore(engine_config(tiny_models[name], tp, block_size)) as core:
        yield Engine(name, core)


@pytest.fixture(scope="module")
def tp1_engines(tiny_models: dict[str, Path]) -> Any:
    """In-process TP=1 engines (cheap), one per model, as the reference for seeded sampling."""
    engines: dict[str, EngineCore] = {}

    def get(name: str) -> EngineCore:
        if name not in engines:
            engines[name] = EngineCore(engine_config(tiny_models[name], 1, 16))
        return engines[name]

    yield get
    for core in engines.values():
        core.shutdown()


def vocab_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


# ---------------------------------------------------------------------- tests


@pytest.mark.slow
def test_greedy_matches_transformers(engine: Engine, hf_reference: Callable) -> None:
    prompts = make_prompts(engine.vocab_size)
    outs = engine.core.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    ref = hf_reference(engine.name)
    for prompt, out, (ref_ids, _) in zip(prompts, outs, ref):
        assert out.finished and out.finish_reason == "length"
        assert out.prompt_token_ids == prompt
        assert out.logprobs is None
        assert out.token_ids == ref_ids, f"prompt of {len(prompt)} tokens"


def test_logprobs_match_transformers(engine: Engine, hf_reference: Callable) -> None:
    prompts = make_prompts(engine.vocab_size)
    outs = engine.core.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    )
    ref = hf_reference(engine.name)
    for prompt, out, (ref_ids, ref_lp) in zip(prompts, outs, ref):
        assert out.token_ids == ref_ids, f"prompt of {len(prompt)} tokens"
        assert out.logprobs is not None and len(out.logprobs) == MAX_NEW
        for step, (lp, token) in enumerate(zip(out.logprobs, out.token_ids)):
            top = torch.topk(ref_lp[step], 5)
            # The top 5 plus the sampled token (greedy: already among the top 5).
            assert set(lp) == set(top.indices.tolist()) | {token}, f"prompt {len(prompt)}, step {step}"
            for tok, value in lp.items():
                assert value == pytest.approx(float(ref_lp[step, tok]), abs=LOGPROBS_ATOL), (
                    f"prompt {len(prompt)}, step {step}, token {tok}"
                )


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(engine: Engine, tp1_engines: Callable) -> None:
    prompts = make_prompts(engine.vocab_size, seed=1)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=MAX_NEW, ignore_eos=True)
              for i in range(len(prompts))]
    first = [o.token_ids for o in engine.core.generate(prompts, params)]
    # Same engine again, with the prompts in another order (different batch rows).
    again = [o.token_ids for o in engine.core.generate(prompts[::-1], params[::-1])][::-1]
    assert again == first
    # A fresh TP=1 engine gives the same tokens as this (possibly TP>1) one.
    reference = [o.token_ids for o in tp1_engines(engine.name).generate(prompts, params)]
    assert reference == first
    # Sampling is really sampling: it does not just reproduce greedy decoding.
    greedy = [o.token_ids for o in engine.core.generate(prompts, SamplingParams(
        temperature=0, max_tokens=MAX_NEW, ignore_eos=True))]
    assert greedy != first
    # Another seed gives another stream.
    other = [o.token_ids for o in engine.core.generate(prompts, [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=MAX_NEW, ignore_eos=True)
        for i in range(len(prompts))])]
    assert other != first
    # top_k=1 is greedy whatever the temperature and seed.
    top1 = [o.token_ids for o in engine.core.generate(prompts, SamplingParams(
        temperature=0.8, top_k=1, seed=3, max_tokens=MAX_NEW, ignore_eos=True))]
    assert top1 == greedy


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_preemption_keeps_greedy_tokens(tp: int, tiny_models: dict[str, Path], hf_reference: Callable) -> None:
    name, block_size, max_len = "llama", 4, 80
    # Just enough blocks for one max-length sequence, for five concurrent requests.
    cfg = engine_config(tiny_models[name], tp, block_size, max_model_len=max_len, max_num_seqs=8,
                        num_gpu_blocks_override=max_len // block_size)
    prompts = make_prompts(vocab_of(tiny_models[name]))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    with EngineCore(cfg) as core:
        assert core.kv_cache_config.num_blocks == max_len // block_size
        ids = [core.add_request(p, params) for p in prompts]
        requests = [core.scheduler.requests[i] for i in ids]
        final: dict[str, Any] = {}
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    final[out.request_id] = out
    assert sum(r.num_preemptions for r in requests) > 0, "the KV budget was meant to force preemption"
    ref = hf_reference(name)
    for prompt, rid, (ref_ids, ref_lp) in zip(prompts, ids, ref):
        out = final[rid]
        assert out.token_ids == ref_ids, f"prompt of {len(prompt)} tokens"
        # One logprobs entry per output token, preempted requests included.
        assert len(out.logprobs) == MAX_NEW
        for step, lp in enumerate(out.logprobs):
            for tok, value in lp.items():
                assert value == pytest.approx(float(ref_lp[step, tok]), abs=LOGPROBS_ATOL)


def test_string_prompts(tmp_path_factory: pytest.TempPathFactory) -> None:
    import tokenizers

    from tests.conftest import tiny_llama_with_tokenizer

    model_dir = tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tok_model") / "llama", init_std=0.1,
                                          vocab_size=320)
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = [
        "Hello, world!",
        "Once upon a time there was a small village near the river, and the people who lived there",
        "What is the capital of France?",
    ]
    hf = _hf_model(model_dir)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    with EngineCore(engine_config(model_dir, 1, 4)) as core:
        outs = core.generate(prompts, params)
        single = core.generate(prompts[1], params)  # a bare string is one prompt
        by_ids = core.generate([tok.encode(p).ids for p in prompts], params)
    assert len(single) == 1 and single[0].token_ids == outs[1].token_ids
    for prompt, out, out_ids in zip(prompts, outs, by_ids):
        ids = tok.encode(prompt).ids
        assert ids[0] == 1  # BOS from the post-processor
        assert out.prompt_token_ids == ids
        assert out.token_ids == out_ids.token_ids
        assert out.token_ids == hf_greedy(hf, ids, MAX_NEW)[0]
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        assert isinstance(out.text, str)


@pytest.mark.parametrize("backend_name", ["torch_sdpa", "cpu"])
@pytest.mark.parametrize("group_bytes", [None, 1], ids=["one-group", "group-per-seq"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (2, 1), (4, 4)])
def test_paged_attention_matches_dense(num_heads: int, num_kv_heads: int, group_bytes: int | None,
                                       backend_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed batches (decodes, a chunk mid-prompt, a whole prompt) on a scattered block
    table against dense causal attention of each sequence's full history, through each
    attention backend."""
    from models.layers.attention import Attention, AttentionMetadata
    from models.layers.attention.backends import torch_sdpa
    from models.layers.attention.backends.cpu_attn import CPUAttentionBackend

    if group_bytes is not None:
        monkeypatch.setattr(torch_sdpa, "DECODE_GROUP_BYTES", group_bytes)
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    head, block_size, num_blocks = 8, 4, 64
    backend = torch_sdpa.TorchSDPABackend() if backend_name == "torch_sdpa" else CPUAttentionBackend(num_layers=1)
    layer = Attention(num_heads, head, head**-0.5, num_kv_heads)
    stale = torch.randn(num_blocks, 2, block_size, num_kv_heads, head, generator=gen)  # stale junk
    layer.bind_kv_cache(stale, backend.make_impl(layer))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    # (context length after this step, tokens computed this step)
    for batch in ([(9, 1), (1, 1), (17, 1), (33, 1)], [(12, 12), (30, 1), (21, 5), (5, 1), (40, 8)]):
        qs, ks, vs, slots, tables, refs, qsl = [], [], [], [], [], [], [0]
        for seq_len, n in batch:
            blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
            tables.append(blocks)
            k_all = torch.randn(seq_len, num_kv_heads, head, generator=gen)
            v_all = torch.randn(seq_len, num_kv_heads, head, generator=gen)
            q = torch.randn(n, num_heads, head, generator=gen)
            for pos in range(seq_len):  # earlier steps' KV is already cached
                slot = blocks[pos // block_size] * block_size + pos % block_size
                if pos < seq_len - n:
                    layer.kv_cache[slot // block_size, 0, slot % block_size] = k_all[pos]
                    layer.kv_cache[slot // block_size, 1, slot % block_size] = v_all[pos]
                else:
                    slots.append(slot)
            qs.append(q)
            ks.append(k_all[seq_len - n:])
            vs.append(v_all[seq_len - n:])
            qsl.append(qsl[-1] + n)
            rep = num_heads // num_kv_heads
            mask = torch.arange(seq_len)[None] <= torch.arange(seq_len - n, seq_len)[:, None]
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k_all.repeat_interleave(rep, 1).transpose(0, 1),
                v_all.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask, scale=head**-0.5)
            refs.append(ref.transpose(0, 1))
        width = max(map(len, tables)) + 2  # padded tables, as the runner builds them
        block_tables = torch.zeros(len(tables), width, dtype=torch.long)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = torch.tensor(t)
        md = backend.build_metadata(AttentionMetadata(torch.tensor(slots), block_tables, [s for s, _ in batch], qsl,
                                                      block_size, req_ids=tuple(str(i) for i in range(len(batch)))))
        out = layer(torch.cat(qs).flatten(1), torch.cat(ks).flatten(1), torch.cat(vs).flatten(1), md)
        torch.testing.assert_close(out.view(-1, num_heads, head), torch.cat(refs), rtol=1e-5, atol=1e-5)
        for blocks in tables:
            free.extend(blocks)


@pytest.mark.slow
def test_long_staggered_generation_matches_transformers(tiny_models: dict[str, Path]) -> None:
    """Decode runs long enough for each layer's decode context to outgrow its buffer
    several times, with sequences of different lengths finishing at different steps
    (the batch shrinks and the context is rebuilt): greedy ids still equal transformers'."""
    hf = _hf_model(tiny_models["llama"])
    prompts = make_prompts(hf.config.vocab_size, seed=5, lens=(3, 17, 40, 9))
    max_new = [150, 90, 120, 60]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_new]
    with EngineCore(engine_config(tiny_models["llama"], 1, 16, max_model_len=256, max_num_batched_tokens=64)) as core:
        outs = core.generate(prompts, params)
    for prompt, n, out in zip(prompts, max_new, outs):
        assert out.token_ids == hf_greedy(hf, prompt, n)[0]


def _uses_shared_memory_collectives(worker: Any) -> bool:
    from distributed import get_tp_group

    return getattr(get_tp_group().communicator, "shm", None) is not None


@pytest.mark.slow
def test_cpu_tp_engine_runs_its_collectives_through_shared_memory(tiny_models: dict[str, Path]) -> None:
    """The TP=2/4 greedy tests above run on this path: every rank has the shm all-reduce."""
    with EngineCore(engine_config(tiny_models["llama"], 2, 16)) as core:
        assert core.collective_rpc(_uses_shared_memory_collectives) == [True, True]


@pytest.mark.slow
@pytest.mark.parametrize("head_size,tp", [(64, 1), (64, 2), (128, 2)])
def test_head_sizes_of_the_vectorised_attention_match_transformers(
    head_size: int, tp: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Head sizes 64 and 128 take the paged kernel's AVX-512 path where the CPU has it,
    for decode and for prefill (whole prompts and, with MAX_BATCHED, prompts prefilled
    in several chunks); the session's tiny models have head size 16 and never do."""
    from engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path_factory.mktemp(f"d{head_size}"), "llama", hidden_size=2 * head_size,
                                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=head_size, init_std=0.1, seed=12,
                                with_tokenizer=False)
    hf = _hf_model(model_dir)
    prompts = make_prompts(hf.config.vocab_size, seed=3)
    with EngineCore(engine_config(model_dir, tp, 16)) as core:
        outs = core.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, MAX_NEW)[0], f"prompt of {len(prompt)} tokens"
