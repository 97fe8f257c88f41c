#!/usr/bin/env python3
"""Write a small, random, HF-format causal-LM checkpoint (llama / mistral / qwen2).

The command line of `engine.tiny_model.make_tiny_model` (see there for what is written).

Usage: ``python scripts/make_tiny_model.py OUT_DIR --arch llama --dtype bfloat16``
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from engine.tiny_model import ARCHS, DTYPES, make_tiny_model  # noqa: E402  (path set up above)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: parse flags, write the checkpoint, print its path and size."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="output directory (created if missing)")
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama", help="model architecture")
    p.add_argument("--hidden-size", type=int, default=64, help="model width")
    p.add_argument("--intermediate-size", type=int, default=128, help="MLP inner width")
    p.add_argument("--num-hidden-layers", type=int, default=2, help="number of decoder layers")
    p.add_argument("--num-attention-heads", type=int, default=4, help="query heads")
    p.add_argument("--num-key-value-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=None, help="per-head dim (default hidden/heads; "
                   "written to config.json only when given)")
    p.add_argument("--vocab-size", type=int, default=320, help="embedding rows")
    p.add_argument("--max-position-embeddings", type=int, default=512, help="max context length")
    p.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base")
    p.add_argument("--rope-scaling", type=json.loads, default=None,
                   help='RoPE scaling as JSON, e.g. \'{"rope_type": "linear", "factor": 2.0}\'')
    p.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="share embed/lm_head (default: off for llama/mistral, on for qwen2)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for weights")
    p.add_argument("--num-shards", type=int, default=2, help="safetensors files (1: no index)")
    p.add_argument("--rms-norm-eps", type=float, default=1e-6, help="RMSNorm epsilon")
    p.add_argument("--init-std", type=float, default=0.02, help="std of matrix/bias init")
    p.add_argument("--no-tokenizer", dest="with_tokenizer", action="store_false",
                   help="do not write tokenizer.json / tokenizer_config.json")
    a = vars(p.parse_args(argv))
    out = make_tiny_model(a.pop("out_dir"), a.pop("arch"), **a)
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{out} {total} bytes")


if __name__ == "__main__":
    main()
