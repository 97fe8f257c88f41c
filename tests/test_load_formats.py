"""Every load format gives the same model, at TP=1 and TP=2, and fails clearly on bad input.

Reference: the default safetensors load of the same tiny checkpoint. Since every format
holds the very same float32 values, logits must be bit-identical (torch.equal), except
for `dummy`, which is compared with itself (TP=2 shards == slices of TP=1).

TP=1 checks run in this process (no process group is needed); all TP=2 checks share one
spawned gloo world (`tp_format_world`, below; spawn pickles it by qualified name).

"Wrong dtype" means: a `.weight`/`.bias` checkpoint tensor that is not floating point
(e.g. int64). A config-level dtype difference (bf16 checkpoint, float32 model) is a
legitimate cast and loads; an integer tensor would be silently cast by `copy_` into
garbage, so every format refuses it, naming the tensor and its dtype.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from config import ConfigError, EngineConfig
from engine.arg_utils import create_engine_config
from model_loader import WeightLoadError, get_model, get_model_loader, get_supported_load_formats
from tests.conftest import REPO, input_ids_for, run_tp

NEW_FORMATS = ("pt", "npcache", "dummy", "sharded_state")
INDEX = "model.safetensors.index.json"
MT = {"enable_multithread_load": True, "num_threads": 2}


# ----------------------------------------------------------------- helpers


def make_config(model_dir: Path | str, **kwargs: Any) -> EngineConfig:
    kwargs.setdefault("dtype", "float32")
    return create_engine_config(model=str(model_dir), device="cpu", use_tqdm_on_load=False, **kwargs)


def load(model_dir: Path | str, **kwargs: Any) -> torch.nn.Module:
    return get_model(make_config(model_dir, **kwargs))


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from tests.tp_helpers import compute_logits_on_rank

    return compute_logits_on_rank(model, ids)


def write_bin_checkpoint(src: Path, dst: Path, shards: bool = True) -> Path:
    """A `.bin` copy of `src`: one pytorch_model file per safetensors shard (or one file)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != INDEX:
            shutil.copyfile(f, dst / f.name)
    st_files = sorted(src.glob("*.safetensors"))
    if shards and len(st_files) > 1:
        for i, f in enumerate(st_files):
            torch.save(load_file(str(f)), dst / f"pytorch_model-{i + 1:05d}-of-{len(st_files):05d}.bin")
    else:
        state: dict[str, torch.Tensor] = {}
        for f in st_files:
            state.update(load_file(str(f)))
        torch.save(state, dst / "pytorch_model.bin")
    return dst


def bin_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.bin"))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def save_with_engine(model_dir: Path, out: Path, max_size: int | None = None) -> None:
    """EngineCore(...).save_sharded_state at TP=1 (in-process uni executor)."""
    from engine.core import EngineCore

    config = make_config(model_dir, max_model_len=32, max_num_batched_tokens=32, max_num_seqs=1,
                         kv_cache_memory_bytes=1 << 20)
    with EngineCore(config) as core:
        core.save_sharded_state(str(out), max_size=max_size)


@pytest.fixture(scope="module")
def formats_root(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints in every format, shared by the module:
    bin (llama, 2 .bin files), bin_tied (qwen2_tied, one file), bin_tp2 (fresh: its
    npcache is built by the two TP ranks at once), sharded1 / sharded2 (llama saved at
    TP=1 by EngineCore, at TP=2 by scripts/save_sharded_state.py, 2+ parts per rank)."""
    root = tmp_path_factory.mktemp("formats")
    dirs = {
        "bin": write_bin_checkpoint(tiny_models["llama"], root / "bin"),
        "bin_tied": write_bin_checkpoint(tiny_models["qwen2_tied"], root / "bin_tied", shards=False),
        "bin_tp2": write_bin_checkpoint(tiny_models["llama"], root / "bin_tp2"),
    }
    save_with_engine(tiny_models["llama"], root / "sharded1", max_size=100_000)
    dirs["sharded1"] = root / "sharded1"
    subprocess.run([sys.executable, str(REPO / "scripts" / "save_sharded_state.py"), str(tiny_models["llama"]),
                    str(root / "sharded2"), "--tp", "2", "--max-size", "60KB", "--device", "cpu",
                    "--dtype", "float32"], cwd=REPO, check=True)
    dirs["sharded2"] = root / "sharded2"
    return dirs


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{model: (input ids, safetensors-loaded TP=1 logits)}."""
    out = {}
    for name in ("llama", "qwen2_tied"):
        ids = input_ids_for(name, 320)
        out[name] = (ids, logits_of(load(tiny_models[name]), ids))
    return out


# ----------------------------------------------------------------- TP=2 world (runs in spawned ranks)


def tp_format_world(rank: int, world_size: int, port: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Each case: {"name", "model", "kwargs", "input_ids" | "expect_error", "params"}.
    Returns {name: {"logits", "params"?}} or, for expect_error, ("error", type, msg) / ("loaded",)."""
    from tests.tp_helpers import compute_logits_on_rank, init_tp, shutdown_tp

    init_tp(rank, world_size, port)
    try:
        results: dict[str, Any] = {}
        for case in cases:
            config = create_engine_config(model=case["model"], dtype="float32", device="cpu", tensor_parallel_size=world_size,
                                          use_tqdm_on_load=False, **case.get("kwargs", {}))
            if case.get("expect_error"):
                try:
                    get_model(config)
                except Exception as e:  # noqa: BLE001
                    results[case["name"]] = ("error", type(e).__name__, str(e))
                else:
                    results[case["name"]] = ("loaded",)
                continue
            model = get_model(config)
            out: dict[str, Any] = {"logits": compute_logits_on_rank(model, case["input_ids"])}
            if case.get("params"):
                out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            results[case["name"]] = out
            del model
        return results
    finally:
        shutdown_tp()


# ----------------------------------------------------------------- every format, same logits


def test_registry_lists_the_new_formats() -> None:
    assert set(NEW_FORMATS) <= set(get_supported_load_formats())
    with pytest.raises(ValueError, match=r"load_format='bogus'.*'dummy'.*'npcache'.*'pt'.*'sharded_state'"):
        get_model_loader(type("LC", (), {"load_format": "bogus"})())


@pytest.mark.slow
def test_every_format_matches_safetensors_tp1(
    tiny_models: dict[str, Path], formats_root: dict[str, Path], reference: dict[str, Any]
) -> None:
    ids, expected = reference["llama"]
    cases: dict[str, tuple[Path, dict[str, Any]]] = {
        "pt": (formats_root["bin"], {"load_format": "pt"}),
        "hf(.bin)": (formats_root["bin"], {"load_format": "hf"}),
        "auto(.bin)": (formats_root["bin"], {}),
        "npcache(build)": (formats_root["bin"], {"load_format": "npcache"}),
        "npcache(cached)": (formats_root["bin"], {"load_format": "npcache"}),
        "multithread safetensors": (tiny_models["llama"], {"model_loader_extra_config": MT}),
        "multithread pt": (formats_root["bin"], {"load_format": "pt", "model_loader_extra_config": MT}),
        "sharded_state": (formats_root["sharded1"], {"load_format": "sharded_state"}),
    }
    manifest = formats_root["bin"] / "np" / "manifest.json"
    for what, (model_dir, kwargs) in cases.items():
        stamp = manifest.stat().st_mtime_ns if what == "npcache(cached)" else None
        assert torch.equal(logits_of(load(model_dir, **kwargs), ids), expected), what
        if stamp is not None:
            assert manifest.stat().st_mtime_ns == stamp, "the npcache was rebuilt although it was up to date"

    # Three shards, one thread: files complete one by one, still every tensor once.
    ids_m = input_ids_for("mistral", 320)
    one_thread = {"enable_multithread_load": True, "num_threads": 1}
    assert torch.equal(logits_of(load(tiny_models["mistral"], model_loader_extra_config=one_thread), ids_m),
                       logits_of(load(tiny_models["mistral"]), ids_m))

    # Tied embeddings: one tensor feeds both; sharded_state stores it once.
    ids_t, expected_t = reference["qwen2_tied"]
    for kwargs in ({"load_format": "pt"}, {"load_format": "npcache"}):
        model = load(formats_root["bin_tied"], **kwargs)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert torch.equal(logits_of(model, ids_t), expected_t), kwargs


@pytest.mark.slow
def test_every_format_matches_safetensors_tp2(
    tiny_models: dict[str, Path], formats_root: dict[str, Path], reference: dict[str, Any]
) -> None:
    ids, _ = reference["llama"]
    llama, bin_dir = str(tiny_models["llama"]), str(formats_root["bin_tp2"])
    cases = [
        {"name": "safetensors", "model": llama},
        {"name": "pt", "model": bin_dir, "kwargs": {"load_format": "pt"}},
        {"name": "hf", "model": bin_dir, "kwargs": {"load_format": "hf"}},
        # No cache yet: both ranks race to build it; the file lock lets one convert.
        {"name": "npcache", "model": bin_dir, "kwargs": {"load_format": "npcache"}},
        {"name": "mt_safetensors", "model": llama, "kwargs": {"model_loader_extra_config": MT}},
        {"name": "mt_pt", "model": bin_dir, "kwargs": {"load_format": "pt", "model_loader_extra_config": MT}},
        {"name": "sharded_state", "model": str(formats_root["sharded2"]), "kwargs": {"load_format": "sharded_state"}},
        {"name": "dummy", "model": llama, "kwargs": {"load_format": "dummy"}, "params": True},
        # Saved at TP=1, loaded at TP=2: rank 1 has no file, rank 0's metadata says tp=1.
        {"name": "sharded_tp_mismatch", "model": str(formats_root["sharded1"]),
         "kwargs": {"load_format": "sharded_state"}, "expect_error": True},
    ]
    for case in cases:
        case.setdefault("input_ids", ids)
    per_rank = run_tp(tp_format_world, 2, cases)

    tp1_dummy = load(tiny_models["llama"], load_format="dummy")
    tp1_dummy_logits = logits_of(tp1_dummy, ids)
    for rank, results in enumerate(per_rank):
        ref = results["safetensors"]["logits"]
        torch.testing.assert_close(ref, reference["llama"][1], atol=1e-4, rtol=1e-4)
        for name in ("pt", "hf", "npcache", "mt_safetensors", "mt_pt", "sharded_state"):
            assert torch.equal(results[name]["logits"], ref), f"{name} rank {rank}"
        # dummy: every TP=2 shard is the slice of the TP=1 weights, so the logits agree too.
        assert_dummy_shards_are_slices(tp1_dummy, results["dummy"]["params"], rank, 2)
        torch.testing.assert_close(results["dummy"]["logits"], tp1_dummy_logits, rtol=1e-4, atol=1e-9)
        status = results["sharded_tp_mismatch"]
        assert status[0] == "error" and status[1] == "WeightLoadError", (rank, status)
        if rank == 1:
            assert "missing rank file" in status[2] and "model-rank-1-part-" in status[2], status
        else:
            assert "tensor_parallel_size=1" in status[2] and "tensor_parallel_size=2" in status[2], status
    assert (formats_root["bin_tp2"] / "np" / "manifest.json").is_file()
    assert not list(formats_root["bin_tp2"].glob("np.tmp-*")), "a temporary npcache dir was left behind"


def assert_dummy_shards_are_slices(full: torch.nn.Module, shard: dict[str, torch.Tensor], rank: int, tp: int) -> None:
    params = dict(full.named_parameters())
    attn = full.model.layers[0].self_attn
    q, kv = attn.q_size, attn.kv_size  # TP=1 sizes
    checked = 0
    for name, got in shard.items():
        want = params[name]
        if "qkv_proj" in name:
            qs, kvs = q // tp, kv // tp
            want = torch.cat([want[rank * qs:(rank + 1) * qs],
                              want[q + rank * kvs:q + (rank + 1) * kvs],
                              want[q + kv + rank * kvs:q + kv + (rank + 1) * kvs]])
        elif "gate_up_proj" in name:
            inter = want.shape[0] // 2
            n = inter // tp
            want = torch.cat([want[rank * n:(rank + 1) * n], want[inter + rank * n:inter + (rank + 1) * n]])
        elif "o_proj" in name or "down_proj" in name:
            n = want.shape[1] // tp
            want = want[:, rank * n:(rank + 1) * n]
        elif "embed_tokens" in name or "lm_head" in name:
            vocab = want.shape[0]
            want = want[rank * got.shape[0]:min(vocab, (rank + 1) * got.shape[0])]
            got = got[: want.shape[0]]
        assert torch.equal(got, want), f"dummy {name} rank {rank} is not the slice of the TP=1 weights"
        checked += 1
    assert checked == len(params)


def test_dummy_is_deterministic_and_small(tiny_models: dict[str, Path]) -> None:
    a = dict(load(tiny_models["qwen2"], load_format="dummy").named_parameters())
    b = dict(load(tiny_models["qwen2"], load_format="dummy").named_parameters())
    c = dict(load(tiny_models["qwen2"], load_format="dummy", seed=1).named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert not torch.equal(a[name], c[name]), f"{name}: the seed has no effect"
        assert a[name].abs().max() <= 1e-3 and a[name].std() > 1e-4, name
    # q, k and v are seeded by their own checkpoint names: no two projections repeat.
    qkv = a["model.layers.0.self_attn.qkv_proj.weight"]
    assert not torch.equal(qkv[:64], torch.cat([qkv[64:96], qkv[64:96]]))
    # Nothing but config.json is needed.
    bf16 = load(tiny_models["qwen2"], load_format="dummy", dtype="bfloat16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}


def test_npcache_bfloat16_is_bit_exact(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from engine.tiny_model import make_tiny_model

    src = make_tiny_model(tmp_path / "bf16", "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128, seed=3, dtype="bfloat16",
                          with_tokenizer=False)
    bin_dir = write_bin_checkpoint(src, tmp_path / "bf16_bin")
    download_dir = tmp_path / "downloads"
    ref = dict(load(src, dtype="bfloat16").named_parameters())
    model = load(bin_dir, dtype="bfloat16", load_format="npcache", download_dir=str(download_dir))
    got = dict(model.named_parameters())
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    # With download_dir the cache lives there (per model), not in the model directory.
    assert not (bin_dir / "np").exists()
    (cache,) = [p for p in (download_dir / "npcache").iterdir() if p.is_dir()]
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["tensors"][0]
    import numpy as np

    assert entry["dtype"] == "bfloat16" and np.load(cache / entry["file"]).dtype == np.uint16


def test_safetensors_win_over_bin_and_ignore_patterns(
    copy_model, formats_root: dict[str, Path], reference: dict[str, Any], tmp_path: Path
) -> None:
    ids, expected = reference["llama"]
    both = copy_model("llama")
    zeros = {k: torch.zeros_like(v) for f in sorted(both.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    torch.save(zeros, both / "pytorch_model.bin")
    for fmt in ("auto", "hf"):
        assert torch.equal(logits_of(load(both, load_format=fmt), ids), expected), fmt
    assert not torch.equal(logits_of(load(both, load_format="pt"), ids), expected)  # pt reads the .bin

    extra = tmp_path / "bin_extra"
    shutil.copytree(formats_root["bin"], extra, ignore=shutil.ignore_patterns("np"))
    torch.save({"extra.weight": torch.zeros(3)}, extra / "zz-extra.bin")
    with pytest.raises(WeightLoadError, match=r"extra\.weight"):
        load(extra, load_format="pt")
    model = load(extra, load_format="pt", ignore_patterns=["zz-*"])
    assert torch.equal(logits_of(model, ids), expected)


# ----------------------------------------------------------------- save_sharded_state


def test_save_sharded_state_files_and_tied_weights(
    tiny_models: dict[str, Path], formats_root: dict[str, Path], reference: dict[str, Any], tmp_path: Path
) -> None:
    from safetensors import safe_open

    sharded1, sharded2 = formats_root["sharded1"], formats_root["sharded2"]
    assert {f.name for f in sharded1.iterdir() if not f.name.startswith("model-rank-")} == {
        "config.json", "generation_config.json"}
    for d, tp in ((sharded1, 1), (sharded2, 2)):
        for rank in range(tp):
            parts = sorted(d.glob(f"model-rank-{rank}-part-*.safetensors"))
            assert len(parts) >= 2, f"max_size did not split rank {rank}'s state"
            for part in parts:
                with safe_open(str(part), "pt") as f:
                    meta = f.metadata()
                assert meta["tp_size"] == str(tp) and meta["rank"] == str(rank) and meta["num_parts"] == str(len(parts))
    assert not list(sharded2.glob("model-rank-2-*"))

    tied_out = tmp_path / "tied_sharded"
    save_with_engine(tiny_models["qwen2_tied"], tied_out, max_size=50_000)
    assert len(list(tied_out.glob("model-rank-0-part-*.safetensors"))) > 1
    names: set[str] = set()
    for part in tied_out.glob("model-rank-0-part-*.safetensors"):
        names |= set(load_file(str(part)))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    ids_t, expected_t = reference["qwen2_tied"]
    model = load(tied_out, load_format="sharded_state")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(logits_of(model, ids_t), expected_t)

    # Saving again into the same directory replaces the earlier files (no stale parts).
    save_with_engine(tiny_models["qwen2_tied"], tied_out)
    assert [f.name for f in tied_out.glob("model-rank-*")] == ["model-rank-0-part-0.safetensors"]


# ----------------------------------------------------------------- clear errors


def test_unknown_load_format_lists_all_valid_ones(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as info:
        make_config(tiny_models["llama"], load_format="tensorizer")
    message = str(info.value)
    assert "load_format='tensorizer'" in message
    for fmt in ("auto", "hf", "safetensors", *NEW_FORMATS):
        assert repr(fmt) in message, fmt


def test_pickle_with_code_is_refused(formats_root: dict[str, Path], tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    crafted = tmp_path / "crafted"
    shutil.copytree(formats_root["bin"], crafted, ignore=shutil.ignore_patterns("np", "*.bin"))
    (crafted / "pytorch_model.bin").write_bytes(pickle.dumps({"model.norm.weight": Payload()}, protocol=2))
    custom = tmp_path / "custom"
    shutil.copytree(crafted, custom)
    torch.save({"model.norm.weight": torch.ones(64), "meta": _CustomObject()}, custom / "pytorch_model.bin")
    for model_dir in (crafted, custom):
        for kwargs in ({"load_format": "pt"}, {"load_format": "auto"}, {"load_format": "npcache"},
                       {"load_format": "pt", "model_loader_extra_config": MT}):
            with pytest.raises(WeightLoadError, match=r"pytorch_model\.bin was refused: it pickles more than tensors"):
                load(model_dir, **kwargs)
    assert not marker.exists(), "the crafted pickle ran code"
    assert not (crafted / "np").exists() or not (crafted / "np" / "manifest.json").exists()


class _CustomObject:
    """A class the weights_only unpickler does not allow."""


def test_truncated_files_name_the_file(formats_root: dict[str, Path], copy_model, tmp_path: Path) -> None:
    bad_bin = tmp_path / "bad_bin"
    shutil.copytree(formats_root["bin"], bad_bin, ignore=shutil.ignore_patterns("np"))
    victim = bin_files(bad_bin)[1]
    truncate(victim)
    for kwargs in ({"load_format": "pt"}, {"load_format": "npcache"},
                   {"load_format": "pt", "model_loader_extra_config": MT}):
        with pytest.raises(WeightLoadError, match=rf"{re.escape(victim.name)} is not a readable PyTorch checkpoint"):
            load(bad_bin, **kwargs)
    assert not (bad_bin / "np").exists(), "a failed conversion left a cache behind"

    bad_st = copy_model("llama")
    shard = sorted(bad_st.glob("*.safetensors"))[1]
    truncate(shard)
    with pytest.raises(WeightLoadError, match=rf"{re.escape(shard.name)}.*truncated"):
        load(bad_st, model_loader_extra_config=MT)

    # A damaged npcache file is named, with the way out.
    good = tmp_path / "good_bin"
    shutil.copytree(formats_root["bin"], good, ignore=shutil.ignore_patterns("np"))
    load(good, load_format="npcache")
    npy = sorted((good / "np").glob("*.npy"))[0]
    truncate(npy)
    with pytest.raises(WeightLoadError, match=rf"{re.escape(npy.name)}.*truncated.*delete .*np"):
        load(good, load_format="npcache")

    # sharded_state: a truncated part file.
    sharded = tmp_path / "sharded_trunc"
    shutil.copytree(formats_root["sharded1"], sharded)
    part = sharded / "model-rank-0-part-1.safetensors"
    truncate(part)
    with pytest.raises(WeightLoadError, match=rf"{re.escape(part.name)}.*truncated"):
        load(sharded, load_format="sharded_state")


def test_integer_weight_is_refused(formats_root: dict[str, Path], copy_model, tmp_path: Path) -> None:
    name = "model.norm.weight"
    st_dir = copy_model("llama")
    index = json.loads((st_dir / INDEX).read_text())
    shard = st_dir / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = torch.ones(64, dtype=torch.int64)
    save_file(tensors, str(shard))
    expected = rf"'{re.escape(name)}'.*dtype torch\.int64.*floating point"
    for kwargs in ({}, {"model_loader_extra_config": MT}):
        with pytest.raises(WeightLoadError, match=expected):
            load(st_dir, **kwargs)

    bin_dir = tmp_path / "int_bin"
    shutil.copytree(formats_root["bin"], bin_dir, ignore=shutil.ignore_patterns("np"))
    for f in bin_files(bin_dir):
        state = torch.load(f, weights_only=True)
        if name in state:
            state[name] = torch.ones(64, dtype=torch.int64)
            torch.save(state, f)
    for kwargs in ({"load_format": "pt"}, {"load_format": "npcache"}):
        with pytest.raises(WeightLoadError, match=expected):
            load(bin_dir, **kwargs)

    sharded = tmp_path / "int_sharded"
    shutil.copytree(formats_root["sharded1"], sharded)
    for part in sorted(sharded.glob("model-rank-0-part-*.safetensors")):
        tensors = load_file(str(part))
        if name in tensors:
            tensors[name] = torch.ones(64, dtype=torch.int64)
            save_file(tensors, str(part), metadata={"tp_size": "1", "rank": "0"})
    with pytest.raises(WeightLoadError, match=rf"'{re.escape(name)}'.*dtype torch\.int64"):
        load(sharded, load_format="sharded_state")


def test_sharded_state_errors(formats_root: dict[str, Path], tiny_models: dict[str, Path], tmp_path: Path) -> None:
    # Saved at TP=2, loaded at TP=1: named as a TP mismatch (no process group needed to see it).
    with pytest.raises(WeightLoadError,
                       match=r"ranks \[0, 1\].*tensor_parallel_size=1.*saved with tensor_parallel_size=2"):
        load(formats_root["sharded2"], load_format="sharded_state")

    # A rank's file is missing.
    missing_rank = tmp_path / "missing_rank"
    shutil.copytree(formats_root["sharded1"], missing_rank)
    for f in missing_rank.glob("model-rank-0-*"):
        f.rename(f.with_name(f.name.replace("rank-0", "rank-1")))
    with pytest.raises(WeightLoadError, match=r"missing rank file.*model-rank-0-part-\*\.safetensors.*ranks \[1\]"):
        load(missing_rank, load_format="sharded_state")

    # A part is missing.
    missing_part = tmp_path / "missing_part"
    shutil.copytree(formats_root["sharded1"], missing_part)
    (missing_part / "model-rank-0-part-1.safetensors").unlink()
    with pytest.raises(WeightLoadError, match=r"missing part file\(s\) \['model-rank-0-part-1\.safetensors'\]"):
        load(missing_part, load_format="sharded_state")

    # Missing and unexpected keys are named (strict, by key, no name mapping).
    keys = tmp_path / "keys"
    shutil.copytree(formats_root["sharded1"], keys)
    part = keys / "model-rank-0-part-0.safetensors"
    tensors = load_file(str(part))
    gone = sorted(tensors)[0]
    tensors.pop(gone)
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(part), metadata={"tp_size": "1", "rank": "0"})
    with pytest.raises(WeightLoadError) as info:
        load(keys, load_format="sharded_state")
    assert gone in str(info.value) and "q_proj" in str(info.value) and "missing" in str(info.value)

    # Not a sharded_state directory at all.
    with pytest.raises(WeightLoadError, match=r"no sharded_state files.*save_sharded_state"):
        load(tiny_models["llama"], load_format="sharded_state")


def test_extra_config_is_validated(tiny_models: dict[str, Path]) -> None:
    for fmt in ("auto", "pt", "dummy", "sharded_state"):
        with pytest.raises(ValueError, match=r"unknown key\(s\) \['threads'\].*valid keys"):
            load(tiny_models["llama"], load_format=fmt, model_loader_extra_config={"threads": 4})
    with pytest.raises(ValueError, match=r"valid keys: \['enable_multithread_load', 'num_threads'\]"):
        load(tiny_models["llama"], model_loader_extra_config={"enable_multithread": True})
    with pytest.raises(ValueError, match=r"num_threads.*must be an int > 0"):
        load(tiny_models["llama"], model_loader_extra_config={"enable_multithread_load": True, "num_threads": 0})
