"""The value types of `engine.serve`'s flags: vLLM's integer and byte-count syntax,
ports, and the --chat-template file-or-inline rule.

Each is an argparse `type=` callable (engine/entrypoints/cli_args.py): it returns the
value or raises argparse.ArgumentTypeError, which argparse turns into a usage error
(exit 2) naming the flag. `load_chat_template` is the exception: it raises ValueError
(or OSError), and `parse_args` turns that into the usage error. Standard library only,
so that `--help` stays fast.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kmgtKMGT])$")


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '1G', '1.5G', '1.5GB' -> bytes (binary units); vLLM's '4k'
    (decimal, 10**3) and '4K' (binary, 2**10) spellings are read as vLLM reads them."""
    match = _HUMAN_INT.match(text.strip())
    if match and (match.group(2).islower() or "." not in match.group(1)):
        return human_readable_int(text)
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 1073741824, 512MiB, 2GiB, 4G)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * (1 << (10 * " KMGT".index(unit or " "))))


def human_readable_int(text: str) -> int:
    """vLLM's integer syntax: '2048'; '1k' / '25.6k' = 1000 / 25600 (k, m, g, t: powers of
    10); '1K' = 1024 (K, M, G, T: powers of 2, whole numbers only)."""
    value = text.strip()
    match = _HUMAN_INT.match(value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer (e.g. 2048, 2k, 2K)") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 10 ** (3 * " kmgt".index(suffix)))
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: decimals are not allowed with binary suffixes like {suffix}; did you mean "
            f"{number}{suffix.lower()}?")
    return int(number) * (1 << (10 * " KMGT".index(suffix)))


def max_model_len_arg(text: str) -> int | None:
    """--max-model-len: vLLM's integer syntax; 'auto' or -1: the model's own length
    (max_position_embeddings)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    value = human_readable_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive token count, 'auto' or -1")
    return value


def port_arg(text: str) -> int:
    """--port: an integer in 0..65535 (0: any free port, reported in the banner)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range: a TCP port is in 0..65535")
    return port


def positive_int(text: str) -> int:
    """vLLM's integer syntax, at least 1 (--tp, --max-num-seqs, --block-size, ...)."""
    value = human_readable_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def load_chat_template(value: str) -> str:
    """--chat-template: a file's contents when `value` names a file, else `value` itself
    when it looks like a Jinja template (it has '{', '}' or a newline), as vLLM reads it.
    Raises ValueError for something path-like that is not a file."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # an inline template longer than a file name may be
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8")
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r} looks like a path, but there is no such file")
