"""model_loader + models: numerics against transformers at TP=1/2/4, and clear failures.

transformers is the oracle (float32, atol 1e-4). The TP checks run in real gloo
process groups (tests/tp_helpers.py); each spawned world checks every model in one go,
because spawning is the expensive part.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from config import ConfigError
from engine.arg_utils import create_engine_config
from model_loader import (
    BaseModelLoader,
    UnsupportedArchitectureError,
    WeightLoadError,
    get_model,
    get_model_loader,
    get_supported_load_formats,
    register_model_loader,
)
from tests.conftest import TINY_MODEL_SPECS, TPWorkerError, input_ids_for, run_tp
from tests.tp_helpers import compute_logits_on_rank, tp_fail_on_rank, tp_load_cases

ATOL = 1e-4
RTOL = 1e-4
INDEX = "model.safetensors.index.json"

# Models compared against transformers (every spec has 4 or 8 heads, so TP=1/2/4 all apply).
ORACLE_MODELS = [
    "llama",
    "mistral",
    "qwen2",
    "qwen2_tied",
    "llama_h8_kv2",
    "llama_v250",
    "mistral_v333",
    "qwen2_tied_v333",
    "llama3_rope",
]


def load(model_dir: Path | str, **kwargs: Any) -> torch.nn.Module:
    kwargs.setdefault("dtype", "float32")
    return get_model(create_engine_config(model=str(model_dir), device="cpu", use_tqdm_on_load=False, **kwargs))


def our_logits(model_dir: Path | str, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return compute_logits_on_rank(load(model_dir, **kwargs), input_ids)


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------- checkpoint surgery


def shard_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def shard_of(model_dir: Path, tensor_name: str) -> Path:
    index = model_dir / INDEX
    if index.is_file():
        return model_dir / json.loads(index.read_text())["weight_map"][tensor_name]
    return model_dir / "model.safetensors"


def edit_checkpoint(model_dir: Path, shard: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite one shard after `edit` mutates its tensors; keep the index in step."""
    tensors = load_file(str(shard))
    before = set(tensors)
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path = model_dir / INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        for name in before - set(tensors):
            del index["weight_map"][name]
        for name in set(tensors) - before:
            index["weight_map"][name] = shard.name
        index_path.write_text(json.dumps(index))


def write_config(model_dir: Path, **changes: Any) -> Path:
    """Set (or, with None, remove) keys of `model_dir`'s config.json; returns its path."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return path


# ----------------------------------------------------------------- numerics: TP=1


@pytest.mark.parametrize("name", ORACLE_MODELS)
def test_logits_match_transformers_tp1(name: str, tiny_models: dict[str, Path], hf_logits) -> None:
    ids, expected = hf_logits(name)
    assert_logits_close(our_logits(tiny_models[name], ids), expected, f"{name} tp=1")


def test_tied_embeddings_checkpoint_has_no_lm_head(tiny_models: dict[str, Path], hf_logits) -> None:
    for name in ("qwen2_tied", "qwen2_tied_v333"):
        names = set()
        for f in shard_files(tiny_models[name]):
            names |= set(load_file(str(f)))
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
        model = load(tiny_models[name])
        assert model.lm_head.weight is model.model.embed_tokens.weight
        ids, expected = hf_logits(name)
        assert_logits_close(compute_logits_on_rank(model, ids), expected, name)


def test_llama3_rope_scaling_is_applied(copy_model, hf_logits) -> None:
    """The llama3 oracle comparison is only meaningful if scaling changes the logits."""
    ids, expected = hf_logits("llama3_rope")
    unscaled = copy_model("llama3_rope")
    write_config(unscaled, rope_scaling=None)
    diff = (our_logits(unscaled, ids) - expected).abs().max().item()
    assert diff > 100 * ATOL, f"rope scaling makes no visible difference ({diff}); the test cannot see it"


def test_strategies_give_identical_logits(tiny_models: dict[str, Path], hf_logits) -> None:
    ids, expected = hf_logits("mistral")  # three shards: prefetch runs ahead across files
    results = {
        strategy: our_logits(tiny_models["mistral"], ids, safetensors_load_strategy=strategy)
        for strategy in (None, "lazy", "eager", "prefetch")
    }
    for strategy, logits in results.items():
        assert torch.equal(logits, results["lazy"]), f"strategy {strategy!r} differs from 'lazy'"
    assert_logits_close(results["lazy"], expected, "mistral lazy")


def test_dtype_auto_and_bfloat16(tiny_models: dict[str, Path]) -> None:
    assert next(load(tiny_models["llama"], dtype="auto").parameters()).dtype == torch.float32
    model = load(tiny_models["llama"], dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


# ----------------------------------------------------------------- numerics: TP=2 and 4


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_logits_match_transformers_tensor_parallel(
    world_size: int, tiny_models: dict[str, Path], hf_logits, copy_model
) -> None:
    cases = []
    for name in ORACLE_MODELS:
        ids, _ = hf_logits(name)
        kwargs = {"safetensors_load_strategy": "eager"} if name == "mistral" else {}
        cases.append({"name": name, "model": str(tiny_models[name]), "input_ids": ids, "kwargs": kwargs})
    # A damaged checkpoint must fail the same clear way on every rank.
    broken = copy_model("llama")
    missing = "model.layers.1.mlp.down_proj.weight"
    edit_checkpoint(broken, shard_of(broken, missing), lambda t: t.pop(missing))
    cases.append({"name": "missing_weight", "model": str(broken), "expect_error": True})

    per_rank = run_tp(tp_load_cases, world_size, cases)

    assert len(per_rank) == world_size
    for rank, results in enumerate(per_rank):
        for name in ORACLE_MODELS:
            _, expected = hf_logits(name)
            got = results[name]
            assert_logits_close(got["logits"], expected, f"{name} tp={world_size} rank={rank}")
            spec = TINY_MODEL_SPECS[name]
            heads, kv_heads = spec["num_attention_heads"], spec["num_key_value_heads"]
            assert got["num_heads"] == heads // world_size
            assert got["num_kv_heads"] == max(1, kv_heads // world_size)
            padded = -(-spec["vocab_size"] // 64) * 64
            assert got["embed_rows"] == -(-padded // world_size)
        err = results["missing_weight"]
        assert err is not None, f"rank {rank} loaded a checkpoint with a missing weight"
        assert err[0] == "WeightLoadError" and missing in err[1], err


@pytest.mark.slow
def test_run_tp_propagates_worker_errors_and_leaves_no_process() -> None:
    import multiprocessing

    import psutil

    with pytest.raises(TPWorkerError, match=r"(?s)rank 1.*RuntimeError: deliberate failure on rank 1.*Traceback"):
        run_tp(tp_fail_on_rank, 2, 1, timeout=60)
    assert multiprocessing.active_children() == []
    leftovers = [p for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
    assert leftovers == [], leftovers


# ----------------------------------------------------------------- clear failures: weights


def test_missing_weight_is_named(copy_model) -> None:
    model_dir = copy_model("llama")
    name = "model.layers.1.mlp.down_proj.weight"
    edit_checkpoint(model_dir, shard_of(model_dir, name), lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match=re.escape(name)):
        load(model_dir)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"])
def test_missing_shard_of_fused_weight_is_named(copy_model, name: str) -> None:
    model_dir = copy_model("llama")
    edit_checkpoint(model_dir, shard_of(model_dir, name), lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match=re.escape(name.rsplit(".", 2)[0])):
        load(model_dir)


def test_unexpected_weight_is_named(copy_model) -> None:
    model_dir = copy_model("llama")
    extra = "model.layers.0.mlp.extra_proj.weight"
    shard = shard_files(model_dir)[0]
    edit_checkpoint(model_dir, shard, lambda t: t.__setitem__(extra, torch.zeros(4, 4)))
    with pytest.raises(WeightLoadError, match=re.escape(extra)):
        load(model_dir)


@pytest.mark.parametrize(
    "name, bad_shape, expected_shape",
    [
        ("model.norm.weight", (60,), (64,)),
        ("model.embed_tokens.weight", (320, 60), (320, 64)),
        ("lm_head.weight", (300, 64), (320, 64)),
        ("model.layers.0.self_attn.o_proj.weight", (64, 60), None),
        ("model.layers.1.self_attn.k_proj.weight", (48, 64), None),
    ],
)
def test_shape_mismatch_names_weight_and_shapes(
    copy_model, name: str, bad_shape: tuple[int, ...], expected_shape: tuple[int, ...] | None
) -> None:
    model_dir = copy_model("llama")
    edit_checkpoint(model_dir, shard_of(model_dir, name), lambda t: t.__setitem__(name, torch.zeros(bad_shape)))
    with pytest.raises(WeightLoadError) as info:
        load(model_dir)
    message = str(info.value)
    assert name in message and "shape mismatch" in message
    assert str(bad_shape) in message
    if expected_shape is not None:
        assert str(expected_shape) in message
    else:  # fused / sharded layers name the expected size of the mismatching dim
        assert "64" in message


def test_truncated_shard_names_the_file(copy_model) -> None:
    model_dir = copy_model("llama")
    shard = shard_files(model_dir)[1]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(WeightLoadError, match=rf"{re.escape(shard.name)}.*truncated"):
        load(model_dir)


@pytest.mark.parametrize("kind", ["random_bytes", "bad_json_header", "empty"])
def test_corrupt_shard_names_the_file(copy_model, kind: str) -> None:
    model_dir = copy_model("llama")
    shard = shard_files(model_dir)[0]
    if kind == "random_bytes":
        data = torch.randint(0, 256, (shard.stat().st_size,), generator=torch.Generator().manual_seed(0))
        shard.write_bytes(bytes(data.to(torch.uint8).tolist()))
    elif kind == "bad_json_header":
        shard.write_bytes((40).to_bytes(8, "little") + b"{not json" + b"\x00" * 200)
    else:
        shard.write_bytes(b"")
    with pytest.raises(WeightLoadError, match=re.escape(shard.name)):
        load(model_dir)


def test_index_pointing_at_missing_shard(copy_model) -> None:
    model_dir = copy_model("mistral")
    gone = shard_files(model_dir)[1]
    gone.unlink()
    with pytest.raises(WeightLoadError, match=rf"{re.escape(gone.name)}.*do not exist"):
        load(model_dir)


def test_unknown_architecture_lists_supported(copy_model) -> None:
    model_dir = copy_model("llama")
    write_config(model_dir, architectures=["FooForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError) as info:
        load(model_dir)
    message = str(info.value)
    assert "FooForCausalLM" in message
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert arch in message


# ----------------------------------------------------------------- clear failures: config


def test_missing_config_json(copy_model) -> None:
    model_dir = copy_model("llama")
    (model_dir / "config.json").unlink()
    with pytest.raises(ConfigError, match=re.escape(str(model_dir / "config.json"))):
        create_engine_config(model=str(model_dir))


def test_model_dir_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "nope"))):
        create_engine_config(model=str(tmp_path / "nope"))


def test_tp_size_must_divide_attention_heads(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3.*num_attention_heads=4"):
        create_engine_config(model=str(tiny_models["llama"]), tensor_parallel_size=3)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("dtype", "float8", ["auto", "float32", "float16", "bfloat16"]),
        ("load_format", "gguf-ish", ["auto", "hf", "safetensors"]),
        ("safetensors_load_strategy", "turbo", ["lazy", "eager", "prefetch"]),
        ("device", "tpu", ["auto", "cpu", "cuda"]),
    ],
)
def test_invalid_choice_names_field_and_allowed_values(
    tiny_models: dict[str, Path], field: str, value: str, allowed: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        create_engine_config(model=str(tiny_models["llama"]), **{field: value})
    message = str(info.value)
    assert field in message and repr(value) in message
    for choice in allowed:
        assert repr(choice) in message, f"{choice!r} missing from {message!r}"


@pytest.mark.parametrize("max_model_len", [0, 1, 100_000])
def test_max_model_len_out_of_range_is_a_config_error(tiny_models: dict[str, Path], max_model_len: int) -> None:
    with pytest.raises(ConfigError, match=rf"max_model_len={max_model_len}"):
        create_engine_config(model=str(tiny_models["llama"]), max_model_len=max_model_len)


# ----------------------------------------------------------------- loader framework


def test_unknown_load_format_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"load_format='nope'.*'auto'.*'hf'.*'safetensors'"):
        get_model_loader(type("LC", (), {"load_format": "nope"})())
    assert {"auto", "hf", "safetensors"} <= set(get_supported_load_formats())


def test_user_loader_and_load_model_order(
    tiny_models: dict[str, Path], hf_logits, monkeypatch: pytest.MonkeyPatch
) -> None:
    import model_loader.base_loader as base_loader
    import model_loader.registry as registry
    from model_loader.default_loader import DefaultModelLoader

    monkeypatch.setattr(registry, "_USER_LOADERS", dict(registry._USER_LOADERS))  # undone after the test
    calls: list[Any] = []

    real_initialize = base_loader.initialize_model
    real_process = base_loader.process_weights_after_loading

    def initialize(config: Any, prefix: str = "") -> torch.nn.Module:
        calls.append(("initialize_model", torch.get_default_dtype()))
        return real_initialize(config, prefix)

    def process(model: torch.nn.Module, after_each: Any = None) -> None:
        calls.append(("process_weights_after_loading", model.training, next(model.parameters()).device))
        real_process(model, after_each)

    monkeypatch.setattr(base_loader, "initialize_model", initialize)
    monkeypatch.setattr(base_loader, "process_weights_after_loading", process)

    @register_model_loader("mine")
    class RecordingLoader(BaseModelLoader):
        def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
            calls.append(("load_weights", model.training, torch.is_grad_enabled(), next(model.parameters()).dtype))
            # A layer hook runs after every weight is in place.
            model.model.norm.process_weights_after_loading = lambda: calls.append("layer hook")
            DefaultModelLoader(self.load_config).load_weights(model, model_config)

    assert "mine" in get_supported_load_formats()
    config = create_engine_config(model=str(tiny_models["llama"]), dtype="float32", device="cpu", load_format="mine",
                                  use_tqdm_on_load=False)
    assert isinstance(get_model_loader(config.load_config), RecordingLoader)
    model = get_model(config)

    assert calls == [
        ("initialize_model", torch.float32),
        ("load_weights", True, False, torch.float32),
        ("process_weights_after_loading", True, torch.device("cpu")),
        "layer hook",
    ]
    assert not model.training
    ids, expected = hf_logits("llama")
    assert_logits_close(compute_logits_on_rank(model, ids), expected, "user loader")

    # The dtype set for construction is in force only while the model is built.
    calls.clear()
    bf16 = get_model(create_engine_config(model=str(tiny_models["llama"]), dtype="bfloat16", device="cpu",
                                          load_format="mine", use_tqdm_on_load=False))
    assert calls[0] == ("initialize_model", torch.bfloat16)
    assert calls[1][3] == torch.bfloat16 and next(bf16.parameters()).dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32


def test_register_model_loader_rejects_non_loaders() -> None:
    with pytest.raises(TypeError, match="BaseModelLoader"):
        register_model_loader("bogus")(object)


def _write_bin_checkpoint(src: Path, dst: Path) -> None:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = {}
    for f in shard_files(src):
        state.update(load_file(str(f)))
    torch.save(state, dst / "pytorch_model.bin")


def test_bin_only_dir_is_refused_by_safetensors_loader(
    tiny_models: dict[str, Path], tmp_path: Path, hf_logits
) -> None:
    model_dir = tmp_path / "bin_only"
    _write_bin_checkpoint(tiny_models["llama"], model_dir)
    with pytest.raises(WeightLoadError, match=r"no weight files matching \['\*\.safetensors'\].*'safetensors'"):
        load(model_dir, load_format="safetensors")
    # "auto" falls back to the .bin file when there is no safetensors file.
    ids, expected = hf_logits("llama")
    assert_logits_close(our_logits(model_dir, ids, load_format="auto"), expected, ".bin via auto")


def test_stray_safetensors_not_in_index_is_ignored(copy_model, hf_logits) -> None:
    model_dir = copy_model("llama")
    save_file({"junk.weight": torch.zeros(3)}, str(model_dir / "consolidated.safetensors"))
    (model_dir / "garbage.safetensors").write_bytes(b"not a safetensors file at all")
    ids, expected = hf_logits("llama")
    assert_logits_close(our_logits(model_dir, ids), expected, "with stray files")


def test_training_files_are_ignored(copy_model, tiny_models: dict[str, Path], hf_logits, tmp_path: Path) -> None:
    model_dir = copy_model("llama_1shard")
    for name in ("optimizer.bin", "training_args.bin"):
        torch.save({"state": torch.zeros(2)}, model_dir / name)
    ids, expected = hf_logits("llama_1shard")
    assert_logits_close(our_logits(model_dir, ids), expected, "with training files")

    # A directory with training files but no weights: they are never taken for weights.
    only_training = tmp_path / "only_training"
    only_training.mkdir()
    (only_training / "config.json").write_text((tiny_models["llama_1shard"] / "config.json").read_text())
    for name in ("optimizer.bin", "training_args.bin"):
        torch.save({"state": torch.zeros(2)}, only_training / name)
    with pytest.raises(WeightLoadError, match="no weight files"):
        load(only_training)


def test_ignore_patterns_are_honoured(copy_model, hf_logits) -> None:
    model_dir = copy_model("llama_1shard")  # no index: every *.safetensors file is a candidate
    save_file({"extra.weight": torch.zeros(3)}, str(model_dir / "extra-weights.safetensors"))
    with pytest.raises(WeightLoadError, match=r"extra\.weight"):
        load(model_dir)
    ids, expected = hf_logits("llama_1shard")
    assert_logits_close(our_logits(model_dir, ids, ignore_patterns=["extra-*"]), expected, "ignore_patterns")


def test_tp1_loads_without_process_group(tiny_models: dict[str, Path]) -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    model = load(tiny_models["llama_h8_kv2"])
    assert model.model.layers[0].self_attn.num_heads == 8
    ids = input_ids_for("x", 320)
    assert compute_logits_on_rank(model, ids).shape == (ids.numel(), 320)
    assert os.environ.get("RANK") is None or dist.is_initialized() is False
