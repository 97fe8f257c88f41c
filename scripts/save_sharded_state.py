#!/usr/bin/env python3
"""Save a model as a pre-sharded checkpoint for `load_format="sharded_state"`.

Loads MODEL (a local directory or a Hub repo id) with tensor_parallel_size N, then
every rank writes its own shard to OUT/model-rank-{rank}-part-{part}.safetensors
(parts of at most --max-size bytes) and config.json / generation_config.json /
tokenizer files are copied to OUT. Load it back with the same N:

    python scripts/save_sharded_state.py MODEL OUT --tp 2 [--max-size 5GB]
    EngineCore(model=OUT, tensor_parallel_size=2, load_format="sharded_state")

The engine is started with a minimal KV cache (one sequence of --max-model-len
tokens), since it only loads and saves.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 5GB, 500MiB, 1000000)")
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return size


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="local model directory or Hub repo id")
    p.add_argument("out", help="output directory")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--max-size", type=parse_size, default=None, help="max bytes per part file (default: one part)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto", help="how to read MODEL (default: auto)")
    p.add_argument("--revision", default=None)
    p.add_argument("--download-dir", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=256, help="only sizes the throwaway KV cache")
    args = p.parse_args(argv)

    from distributed.utils import cdiv
    from engine import EngineConfig
    from engine.arg_utils import create_engine_config
    from engine.core import EngineCore

    common = dict(tensor_parallel_size=args.tp, dtype=args.dtype, load_format=args.load_format,
                  revision=args.revision, download_dir=args.download_dir, device=args.device)
    probe = create_engine_config(model=args.model, **common)  # resolves a Hub id once
    max_len = min(args.max_model_len, probe.model_config.max_model_len)
    # Just the blocks of one max_model_len sequence, with no profile run.
    config = EngineConfig(model=probe.model, max_model_len=max_len, max_num_batched_tokens=max_len,
                          max_num_seqs=1, num_gpu_blocks_override=cdiv(max_len, probe.block_size), **common)
    start = time.perf_counter()
    with EngineCore(config) as core:
        loaded = time.perf_counter()
        core.save_sharded_state(args.out, max_size=args.max_size)
    files = sorted(Path(args.out).glob("model-rank-*-part-*.safetensors"))
    print(f"loaded {args.model} at tp={args.tp} in {loaded - start:.1f}s; wrote {len(files)} file(s) "
          f"({sum(f.stat().st_size for f in files) / 1e9:.3f} GB) to {args.out} in {time.perf_counter() - loaded:.1f}s")


if __name__ == "__main__":
    main()
