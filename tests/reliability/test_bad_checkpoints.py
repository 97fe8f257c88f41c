"""Bad checkpoints: every damaged or hostile file is refused with an error naming the
file and the tensor or field at fault, before anything large is allocated, and no code
from a checkpoint ever runs.

All in process at TP=1 (the checks run on every rank alike, before any collective), on
private copies of the session's tiny checkpoints (`copy_model`).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import struct
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from config import ConfigError
from engine.arg_utils import create_engine_config
from model_loader import WeightLoadError, get_model
from model_loader.pt_weights import load_pt_file
from model_loader.safetensors_reader import read_safetensors_header
from tests.test_model_loading import write_config

INDEX = "model.safetensors.index.json"


def load(model_dir: Path, **kwargs: Any) -> torch.nn.Module:
    return get_model(create_engine_config(model=str(model_dir), device="cpu", dtype="float32", use_tqdm_on_load=False,
                                          **kwargs))


def shard_of(model_dir: Path, tensor: str) -> Path:
    return model_dir / json.loads((model_dir / INDEX).read_text())["weight_map"][tensor]


def read_raw(path: Path) -> tuple[dict[str, Any], bytes]:
    """(header JSON, data section) of a safetensors file, read without our reader."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def write_raw(path: Path, header: dict[str, Any], data: bytes, header_len: int | None = None) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


def rewrite_header(path: Path, edit: Callable[[dict[str, Any], int], None]) -> None:
    """Rewrite `path`'s header after `edit(header, data_size)` mutates it; data unchanged."""
    header, data = read_raw(path)
    edit(header, len(data))
    write_raw(path, header, data)


def two_largest(header: dict[str, Any]) -> tuple[str, str]:
    names = sorted((k for k in header if k != "__metadata__"),
                   key=lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0])
    return names[-1], names[-2]


# ----------------------------------------------------------------- safetensors headers


@pytest.mark.parametrize("header_len", [2**63 + 5, 150 << 20, 1 << 40])
def test_absurd_header_length_is_refused_before_allocating(tmp_path: Path, header_len: int) -> None:
    # A sparse 300 MiB file: a reader that trusted the length (or read up to the file's
    # size) would allocate 150 MiB or more; ours reads 8 bytes and stops.
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", header_len))
        f.truncate(300 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(WeightLoadError) as info:
            read_safetensors_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(path) in str(info.value)
    assert f"header length {header_len}" in str(info.value)
    assert peak < 1 << 20, f"reading a bad header allocated {peak} bytes"


def test_absurd_header_length_in_a_model_names_the_shard(copy_model) -> None:
    model_dir = copy_model("llama")
    shard = sorted(model_dir.glob("*.safetensors"))[0]
    header, data = read_raw(shard)
    write_raw(shard, header, data, header_len=1 << 60)
    with pytest.raises(WeightLoadError, match=rf"{re.escape(str(shard))}.*header length {1 << 60} exceeds"):
        load(model_dir)


def test_overlapping_tensors_are_refused_naming_both(copy_model) -> None:
    model_dir = copy_model("llama")
    shard = sorted(model_dir.glob("*.safetensors"))[0]
    names: list[str] = []

    def overlap(header: dict[str, Any], _: int) -> None:
        big, other = two_largest(header)
        begin, end = header[big]["data_offsets"]
        # `other` now starts inside `big` (same size as before, so it still ends inside the file).
        size = header[other]["data_offsets"][1] - header[other]["data_offsets"][0]
        start = begin + (end - begin) // 2
        header[other]["data_offsets"] = [start, start + size]
        names.extend([big, other])

    rewrite_header(shard, overlap)
    with pytest.raises(WeightLoadError) as info:
        read_safetensors_header(shard)
    message = str(info.value)
    assert str(shard) in message and "overlap" in message
    assert all(repr(n) in message for n in names), message
    # The same error through the engine's loader, whichever read strategy.
    for kwargs in ({}, {"safetensors_load_strategy": "eager"},
                   {"model_loader_extra_config": {"enable_multithread_load": True, "num_threads": 2}}):
        with pytest.raises(WeightLoadError, match=rf"{re.escape(str(shard))} is corrupt: tensors .* overlap"):
            load(model_dir, **kwargs)


def test_tensor_past_the_end_of_the_file_is_refused(copy_model) -> None:
    model_dir = copy_model("llama")
    shard = sorted(model_dir.glob("*.safetensors"))[1]
    moved: list[str] = []

    def past_end(header: dict[str, Any], data_size: int) -> None:
        name = two_largest(header)[0]
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [data_size - (end - begin) + 64, data_size + 64]
        moved.append(name)

    rewrite_header(shard, past_end)
    with pytest.raises(WeightLoadError, match=rf"{re.escape(str(shard))} is truncated or corrupt: "
                                              rf"tensor '{re.escape(moved[0])}' ends at byte"):
        load(model_dir)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("data_offsets", [-8, 0], "negative"),
        ("data_offsets", [0.0, 8.0], "not an integer"),
        ("data_offsets", [0, 8, 16], "too many values"),
        ("shape", [-1, 4], "negative"),
        ("shape", [2.5], "not an integer"),
        ("shape", "64", "not an integer"),
        ("dtype", "F128", "F128"),
    ],
)
def test_malformed_tensor_entry_names_file_and_tensor(tmp_path: Path, field: str, value: Any, expected: str) -> None:
    path = tmp_path / "model.safetensors"
    header = {"a.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b.weight": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}
    header["b.weight"][field] = value
    write_raw(path, header, b"\0" * 16)
    with pytest.raises(WeightLoadError, match=rf"{re.escape(str(path))}.*'b\.weight'.*{re.escape(expected)}"):
        read_safetensors_header(path)


def test_bad_metadata_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    write_raw(path, {"__metadata__": ["not", "a", "map"], "a": {"dtype": "F32", "shape": [1],
                                                                "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(WeightLoadError, match=rf"{re.escape(str(path))}.*__metadata__"):
        read_safetensors_header(path)


# ------------------------------------------------------------------------ the index


@pytest.mark.parametrize("entry", ["../{shard}", "/etc/hostname", "sub/{shard}", "..", ""])
def test_index_entry_outside_the_model_directory_is_refused(copy_model, entry: str) -> None:
    model_dir = copy_model("mistral")
    index = json.loads((model_dir / INDEX).read_text())
    tensor = "model.norm.weight"
    shard = index["weight_map"][tensor]
    # The escaping target exists, so only the name check can stop it.
    shutil.copy(model_dir / shard, model_dir.parent / shard)
    (model_dir / "sub").mkdir()
    shutil.copy(model_dir / shard, model_dir / "sub" / shard)
    index["weight_map"][tensor] = entry.format(shard=shard)
    (model_dir / INDEX).write_text(json.dumps(index))
    with pytest.raises(WeightLoadError) as info:
        load(model_dir)
    message = str(info.value)
    assert str(model_dir / INDEX) in message and repr(tensor) in message
    assert "points outside the model directory" in message


@pytest.mark.parametrize("weight_map", [["a", "b"], {"model.norm.weight": 3}, {"model.norm.weight": ["x"]}])
def test_malformed_index_is_refused(copy_model, weight_map: Any) -> None:
    model_dir = copy_model("mistral")
    (model_dir / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(WeightLoadError, match=rf"{re.escape(str(model_dir / INDEX))} is not a valid safetensors index"):
        load(model_dir)


# ------------------------------------------------------------------- NaN / Inf weights


def _poison(model_dir: Path, name: str) -> Path:
    shard = shard_of(model_dir, name)
    tensors = load_file(str(shard))
    t = tensors[name].clone()
    t.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    tensors[name] = t
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return shard


def test_nan_and_inf_weights_warn_naming_the_tensor_behind_a_flag(copy_model, caplog: pytest.LogCaptureFixture) -> None:
    model_dir = copy_model("llama")
    name = "model.layers.1.self_attn.o_proj.weight"
    shard = _poison(model_dir, name)
    caplog.set_level(logging.WARNING, logger="model_loader")
    load(model_dir)  # off by default: no scan, no warning
    assert not [r for r in caplog.records if "NaN" in r.getMessage()]

    for kwargs in ({}, {"model_loader_extra_config": {"enable_multithread_load": True, "num_threads": 2}}):
        caplog.clear()
        model = load(model_dir, check_weights_finite=True, **kwargs)  # a warning, and the load goes on
        warnings = [r.getMessage() for r in caplog.records if "NaN" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert repr(name) in warnings[0] and str(shard) in warnings[0]
        assert "1 NaN and 2 Inf" in warnings[0]
        assert not bool(torch.isfinite(dict(model.named_parameters())[name]).all())


def test_non_finite_check_covers_pt_files(copy_model, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model_dir = copy_model("llama")
    name = "model.norm.weight"
    _poison(model_dir, name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for f in model_dir.iterdir():
        if f.suffix == ".json" and f.name != INDEX:
            shutil.copy(f, bin_dir / f.name)
    for i, shard in enumerate(sorted(model_dir.glob("*.safetensors"))):
        torch.save(load_file(str(shard)), bin_dir / f"pytorch_model-{i}.bin")
    caplog.set_level(logging.WARNING, logger="model_loader")
    load(bin_dir, load_format="pt", check_weights_finite=True)
    [warning] = [r.getMessage() for r in caplog.records if "NaN" in r.getMessage()]
    assert repr(name) in warning and "pytorch_model-" in warning


# ------------------------------------------------------------------------ config.json


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"num_hidden_layers": -1}, "num_hidden_layers=-1 must be between 1"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be between 1"),
        ({"vocab_size": 0}, "vocab_size=0 must be between 1"),
        ({"hidden_size": 1 << 40}, f"hidden_size={1 << 40} must be between 1"),
        ({"hidden_size": "64"}, "hidden_size='64' must be an integer"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers=2.5 must be an integer"),
        ({"num_attention_heads": True}, "num_attention_heads=True must be an integer"),
        ({"num_attention_heads": 6, "num_key_value_heads": 2}, "num_attention_heads=6 does not divide hidden_size=64"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
        ({"max_position_embeddings": 0}, "max_position_embeddings=0 must be between 1"),
        ({"intermediate_size": None}, "lacks the required key 'intermediate_size'"),
        ({"vocab_size": None}, "lacks the required key 'vocab_size'"),
        ({"architectures": None}, "lacks the required key 'architectures'"),
        ({"architectures": []}, "architectures=[] must be a non-empty list"),
        ({"architectures": "LlamaForCausalLM"}, "architectures='LlamaForCausalLM' must be a non-empty list"),
        ({"rope_theta": -1}, "rope_theta=-1 must be a positive number"),
        ({"rms_norm_eps": "tiny"}, "rms_norm_eps='tiny' must be a positive number"),
        ({"torch_dtype": ["float32"], "dtype": None}, "torch_dtype=['float32'] is not one of"),
    ],
)
def test_absurd_or_missing_config_field_is_named(copy_model, changes: dict[str, Any], expected: str) -> None:
    model_dir = copy_model("llama")
    path = write_config(model_dir, **changes)
    with pytest.raises(ConfigError) as info:
        create_engine_config(model=str(model_dir), device="cpu")
    message = str(info.value)
    assert str(path) in message and expected in message, message


@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8", b"[1, 2]", b'{"a": ' * 100000])
def test_unreadable_config_json_names_the_file(copy_model, content: bytes) -> None:
    model_dir = copy_model("llama")
    (model_dir / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(str(model_dir / "config.json"))):
        create_engine_config(model=str(model_dir), device="cpu")


def test_explicit_head_dim_need_not_divide_hidden_size(copy_model) -> None:
    # Qwen3 / Gemma style: head_dim given, heads * head_dim != hidden_size is legitimate.
    model_dir = copy_model("llama")
    write_config(model_dir, num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    config = create_engine_config(model=str(model_dir), device="cpu")
    assert config.model_config.num_attention_heads == 6


# ---------------------------------------------------------------- no code from a checkpoint


def test_trust_remote_code_is_refused() -> None:
    from engine.entrypoints.cli_args import build_parser

    with pytest.raises(TypeError, match="trust_remote_code"):
        create_engine_config(model="unused", trust_remote_code=True)  # type: ignore[call-arg]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["MODEL", "--trust-remote-code"])


def test_auto_map_code_in_the_model_directory_never_runs(copy_model, tmp_path: Path) -> None:
    model_dir = copy_model("llama")
    marker = tmp_path / "RAN"
    payload = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    for module in ("modeling_evil", "configuration_evil", "tokenization_evil"):
        (model_dir / f"{module}.py").write_text(payload)
    write_config(model_dir, auto_map={
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
        "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None],
    })
    model = load(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not marker.exists(), "code from the checkpoint directory ran"


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_pickled_code_is_refused_even_when_torch_is_told_otherwise(
    copy_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns torch.load's default to unsafe; an explicit
    # weights_only=True (ours, always) must still win.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "PWNED"
    model_dir = copy_model("llama")
    bin_dir = tmp_path / "evil"
    bin_dir.mkdir()
    shutil.copy(model_dir / "config.json", bin_dir / "config.json")
    state: dict[str, Any] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    state["model.norm.weight"] = _RunsCode(marker)
    for protocol, path in ((2, bin_dir / "pytorch_model.bin"), (4, tmp_path / "legacy.pt")):
        path.write_bytes(pickle.dumps(state, protocol=protocol))
        with pytest.raises(WeightLoadError, match=rf"{re.escape(path.name)} was refused: it pickles more than tensors"):
            load_pt_file(path)
    # torch's zip format too (what torch.save writes), through the engine's loader.
    torch.save(state, bin_dir / "pytorch_model.bin")
    for load_format in ("auto", "pt", "npcache"):
        with pytest.raises(WeightLoadError, match=r"pytorch_model\.bin was refused"):
            load(bin_dir, load_format=load_format)
    assert not marker.exists(), "the pickled payload ran"
