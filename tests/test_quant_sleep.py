"""Sleep mode and the worker's accounting on pre-quantised and GGUF models.

The quantised layouts (the WNA16 buffers a GPTQ checkpoint is repacked into, a GGUF
file's blocks) are registered buffers and parameters, so the worker counts them
(`model_memory_usage`, the start-up report) and level 2 releases and rebuilds them:
after each level the engine gives the same greedy tokens as before, and level 2
reports freeing at least the weights' bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from config import SamplingParams
from engine.core import EngineCore
from engine.tiny_model import make_tiny_model
from tests.quant_checkpoints import random_llama_state_dict, tiny_llama_config, write_quantized_checkpoint
from tests.test_generation import make_prompts
from tests.test_gguf import write_gguf
from tests.wna16_formats import gptq_quantizer


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant_sleep")
    config = tiny_llama_config()
    gptq = write_quantized_checkpoint(
        root / "gptq", config, random_llama_state_dict(config, seed=41), gptq_quantizer(4, 128, True, False),
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
         "checkpoint_format": "gptq", "lm_head": False}, dtype=torch.float16)
    plain = make_tiny_model(root / "plain", "llama", hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=320, seed=42, init_std=0.05,
                            with_tokenizer=False)
    return {"gptq": gptq.path, "gguf_q4_k": write_gguf(plain, root / "q4_k.gguf", "Q4_K")}


def _quantised_tensors(worker: Any) -> int:
    """Bytes of the integer tensors (codes, blocks) the rank's model holds."""
    model = worker.model_runner.model
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
               if not t.is_floating_point())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gptq", "gguf_q4_k"])
def test_sleep_and_wake_keep_a_quantised_model(models: dict[str, Path], name: str) -> None:
    prompts = make_prompts(320, seed=4, lens=(6, 19))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert_sleep_and_wake_keep(models[name], prompts, params, _quantised_tensors)


def assert_sleep_and_wake_keep(model: Path, prompts: list[list[int]], params: SamplingParams,
                               quantised_bytes: Any) -> None:
    """Through sleep levels 1 and 2 (float32, CPU, one rank): the worker counts the
    quantised tensors (`quantised_bytes(worker)`, in bytes) among the weights, level 2
    reports freeing all the weights, and after each wake-up the greedy tokens and the
    quantised bytes are as before."""
    with EngineCore(model=str(model), device="cpu", dtype="float32", max_model_len=64,
                    kv_cache_memory_bytes=4 << 20, use_tqdm_on_load=False, enable_sleep_mode=True) as core:
        reference = [o.token_ids for o in core.generate(prompts, params)]
        (weights,) = core.collective_rpc(lambda worker: worker.model_memory_usage)
        (quantised,) = core.collective_rpc(quantised_bytes)
        assert 0 < quantised < weights  # the codes are counted, next to scales, norms and tables
        for level in (1, 2):
            (report,) = core.sleep(level)
            if level == 2:
                assert report["bytes"]["weights"] == weights
            core.wake_up()
            assert [o.token_ids for o in core.generate(prompts, params)] == reference, f"level {level}"
            assert core.collective_rpc(quantised_bytes) == [quantised]
