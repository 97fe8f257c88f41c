"""The random-weight Llama (or Qwen3-MoE) GGUF files bench_vs_llamacpp.py measures: F16, Q8_0 and Q4_K_M.

`ensure_gguf_files(root, spec, file_types, llamacpp_python)` writes each file once and
caches it under `root/<spec tag>/` (a file is reused while its marker, the spec it was
written from, matches). Every file holds the same random weights (N(0, 0.02) per
tensor, seeded by the tensor's index; norms 1), so the three differ only in storage:

- F16: every 2-D tensor float16; Q8_0: every 2-D tensor Q8_0, written by gguf-py;
- Q4_K_M: llama.cpp's own mix, written by llama.cpp's own quantiser
  (`ggml_quantize_chunk`, exported by the peer's shared object): Q4_K everywhere except
  output.weight (Q6_K) and, in the layers `use_more_bits` picks, attn_v and ffn_down
  (Q6_K), as `llama_tensor_get_type` chooses for LLAMA_FTYPE_MOSTLY_Q4_K_M. gguf-py can
  read K-quants but not write them, and our runtime never imports the peer: the rows
  go through a pipe to `bench_llamacpp_peer.py quantize` run by the peer venv's python.

1-D tensors (the norms) stay F32, as llama.cpp's converter keeps them. The tokenizer is
engine/tiny_model.py's byte-level BPE padded to the vocabulary with `[PADi]` tokens,
stored with the metadata llama.cpp requires to load a file (`tokenizer.ggml.model`
"gpt2", `tokenizer.ggml.pre` "default", tokens, types, merges as "a b", bos/eos) and
`add_bos_token` false, so that token-id prompts reach both engines verbatim.

Memory while writing: one tensor in float32 plus its stored form (the writer streams
tensor data after the header). Not a script of its own.
"""

from __future__ import annotations

import json
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "bench_llamacpp_peer.py"
FILE_TYPES = ("F16", "Q8_0", "Q4_K_M")


@dataclass(frozen=True)
class GGUFModelSpec:
    """A Llama's shape, or with `num_experts` a Qwen3-MoE's (llama.cpp's qwen3moe: per-head
    q/k norms, every layer `num_experts` experts `intermediate_size` wide, top
    `experts_per_tok`). FULL_SPEC is issue 37's 853M-parameter model; MOE_SPEC
    bench_moe.py's 0.39B Qwen3-MoE shape."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    context_length: int = 2048
    num_experts: int = 0
    experts_per_tok: int = 0

    @property
    def arch(self) -> str:
        return "qwen3moe" if self.num_experts else "llama"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def tag(self) -> str:
        experts = f"-e{self.num_experts}k{self.experts_per_tok}" if self.num_experts else ""
        return (f"{self.arch}-h{self.hidden_size}-i{self.intermediate_size}-l{self.num_hidden_layers}"
                f"-a{self.num_attention_heads}-kv{self.num_key_value_heads}-v{self.vocab_size}{experts}")

    def kv_bytes_per_position(self, element_bytes: int = 2) -> int:
        """K and V of one position over every layer (both engines cache 16-bit values)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_bytes

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape [rows, n_per_row]) of every tensor, in file order."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (self.vocab_size, h))]
        i_size, e = self.intermediate_size, self.num_experts
        for i in range(self.num_hidden_layers):
            b = f"blk.{i}."
            out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (h, h)), (b + "attn_k.weight", (kv, h)),
                    (b + "attn_v.weight", (kv, h)), (b + "attn_output.weight", (h, h)), (b + "ffn_norm.weight", (h,))]
            if e:
                out += [(b + "attn_q_norm.weight", (self.head_dim,)), (b + "attn_k_norm.weight", (self.head_dim,)),
                        (b + "ffn_gate_inp.weight", (e, h)), (b + "ffn_gate_exps.weight", (e, i_size, h)),
                        (b + "ffn_up_exps.weight", (e, i_size, h)), (b + "ffn_down_exps.weight", (e, h, i_size))]
            else:
                out += [(b + "ffn_gate.weight", (i_size, h)), (b + "ffn_up.weight", (i_size, h)),
                        (b + "ffn_down.weight", (h, i_size))]
        return out + [("output_norm.weight", (h,)), ("output.weight", (self.vocab_size, h))]

    def num_params(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.tensors())


FULL_SPEC = GGUFModelSpec(2048, 5632, 16, 32, 8, 32000)  # 852.7M parameters, untied LM head
QUICK_SPEC = GGUFModelSpec(256, 768, 2, 4, 2, 8192)  # K-quant rows need multiples of 256
MOE_SPEC = GGUFModelSpec(1024, 768, 8, 16, 4, 32000, num_experts=16, experts_per_tok=4)  # 0.39B parameters
QUICK_MOE_SPEC = GGUFModelSpec(256, 256, 2, 4, 2, 8192, num_experts=8, experts_per_tok=2)


# --------------------------------------------------------------------------- which type each tensor gets


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers a _M mix keeps at more bits."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def storage_type(name: str, shape: tuple[int, ...], file_type: str, n_layers: int) -> str:
    """The GGML type `name` is stored as in a `file_type` file."""
    if len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):  # norms and routers, as llama.cpp keeps them
        return "F32"
    if file_type != "Q4_K_M":
        return file_type
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) and _use_more_bits(
            int(name.split(".")[1]), n_layers):
        return "Q6_K"
    return "Q4_K"


def _stored_nbytes(shape: tuple[int, ...], ggml_type: str) -> int:
    import gguf

    if ggml_type in ("F32", "F16"):
        return int(np.prod(shape)) * (4 if ggml_type == "F32" else 2)
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]]
    return int(np.prod(shape[:-1])) * (shape[-1] // block) * block_bytes


def bytes_read_per_token(path: Path) -> int:
    """Weight bytes one decode step streams: every tensor of the file but the embedding
    table, of which a step reads one row (a tied file reads it whole as the LM head); of
    a mixture of experts' stacks, the share of the experts one token uses."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    used = reader.fields.get(f"{arch}.expert_used_count")
    share = (int(used.parts[-1][0]) / int(reader.fields[f"{arch}.expert_count"].parts[-1][0])) if used else 1.0
    return int(sum(int(t.n_bytes) * (share if "_exps." in t.name else 1) for t in reader.tensors
                   if tied or t.name != "token_embd.weight"))


# --------------------------------------------------------------------------- writing


def _random_weights(spec: GGUFModelSpec) -> Iterator[tuple[str, np.ndarray]]:
    for index, (name, shape) in enumerate(spec.tensors()):
        if len(shape) == 1:
            yield name, np.ones(shape, dtype=np.float32)
        else:
            rng = np.random.default_rng(index)
            yield name, rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)


class PeerQuantizer:
    """llama.cpp's quantiser in a peer-venv child: `quantize(rows, ggml_type)` sends the
    float32 rows down its stdin and reads the blocks back. Use as a context manager; the
    child ends when its stdin closes."""

    def __init__(self, llamacpp_python: str) -> None:
        self.proc = subprocess.Popen([llamacpp_python, str(PEER_SCRIPT), "quantize"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)

    def quantize(self, rows: np.ndarray, ggml_type: str) -> np.ndarray:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        header = {"type": ggml_type, "nrows": rows.shape[0], "n_per_row": rows.shape[1]}
        self.proc.stdin.write((json.dumps(header) + "\n").encode())
        self.proc.stdin.write(np.ascontiguousarray(rows, dtype=np.float32).tobytes())
        self.proc.stdin.flush()
        size_bytes = self.proc.stdout.read(8)
        if len(size_bytes) != 8:
            raise RuntimeError(f"llama.cpp's quantiser ({PEER_SCRIPT.name} quantize) exited with {self.proc.wait()}")
        (size,) = struct.unpack("<Q", size_bytes)
        data = np.frombuffer(self.proc.stdout.read(size), dtype=np.uint8)
        return data.reshape(rows.shape[0], -1)

    def __enter__(self) -> "PeerQuantizer":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.wait(timeout=60) != 0 and exc[0] is None:
            raise RuntimeError(f"llama.cpp's quantiser exited with {self.proc.returncode}")


def _add_tokenizer(writer, spec: GGUFModelSpec) -> None:
    import gguf

    from engine.tiny_model import BOS_ID, EOS_ID, SPECIAL_TOKENS, build_tokenizer

    tok = json.loads(build_tokenizer(spec.vocab_size).to_str())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(spec.vocab_size)]
    types = [gguf.TokenType.CONTROL if i < len(SPECIAL_TOKENS) else
             gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.USER_DEFINED for i in range(spec.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)


def write_gguf(path: Path, spec: GGUFModelSpec, file_type: str, quantizer: PeerQuantizer | None) -> Path:
    """Write `spec`'s random weights stored as `file_type` to `path` (see the module docstring)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(path), spec.arch)
    writer.add_name(f"random {spec.tag}")
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.num_hidden_layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_attention_heads)
    writer.add_head_count_kv(spec.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_vocab_size(spec.vocab_size)
    if spec.num_experts:
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.experts_per_tok)
        writer.add_expert_feed_forward_length(spec.intermediate_size)
    writer.add_file_type({"F16": gguf.LlamaFileType.MOSTLY_F16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M}[file_type])
    _add_tokenizer(writer, spec)
    layers = spec.num_hidden_layers
    plan = [(name, shape, storage_type(name, shape, file_type, layers)) for name, shape in spec.tensors()]
    for name, shape, ggml_type in plan:
        nbytes = _stored_nbytes(shape, ggml_type)
        if ggml_type in ("F32", "F16"):
            writer.add_tensor_info(name, shape, np.dtype(np.float32 if ggml_type == "F32" else np.float16), nbytes)
        else:
            rows = shape[:-1]
            writer.add_tensor_info(name, (*rows, nbytes // int(np.prod(rows))), np.dtype(np.uint8), nbytes,
                                   Q[ggml_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for (_name, data), (_, _, ggml_type) in zip(_random_weights(spec), plan):
        if ggml_type == "F32":
            stored = data
        elif ggml_type == "F16":
            stored = data.astype(np.float16)
        elif ggml_type == "Q8_0":
            stored = gguf.quants.quantize(data, Q.Q8_0)
        else:
            if quantizer is None:
                raise ValueError(f"{file_type} needs llama.cpp's quantiser (--llamacpp-python)")
            # (a stack of experts as its rows)
            stored = quantizer.quantize(data.reshape(-1, data.shape[-1]), ggml_type).reshape(*data.shape[:-1], -1)
        writer.write_tensor_data(stored)
    writer.close()
    return path


def ensure_gguf_files(root: Path, spec: GGUFModelSpec, file_types: list[str],
                      llamacpp_python: str | None) -> dict[str, Path]:
    """The cached file of each type in `file_types` (see the module docstring), written if
    missing. Raises ValueError for Q4_K_M without `llamacpp_python`."""
    out_dir = root / spec.tag
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for file_type in file_types:
        path = out_dir / f"{spec.tag}-{file_type}.gguf"
        marker = path.with_suffix(".spec.json")
        wanted = json.dumps({"spec": asdict(spec), "file_type": file_type, "format": 1})
        if not (path.is_file() and marker.is_file() and marker.read_text() == wanted):
            print(f"writing {path} ...", flush=True)
            t0 = time.perf_counter()
            tmp = path.with_suffix(".tmp")
            if file_type == "Q4_K_M":
                if not llamacpp_python:
                    raise ValueError("Q4_K_M is written by llama.cpp's quantiser: give the peer's python")
                with PeerQuantizer(llamacpp_python) as quantizer:
                    write_gguf(tmp, spec, file_type, quantizer)
            else:
                write_gguf(tmp, spec, file_type, None)
            tmp.rename(path)
            marker.write_text(wanted)
            print(f"  {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)
        files[file_type] = path
    return files

