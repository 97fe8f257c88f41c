"""Compile a small C kernel for this CPU on first use, and cache the library.

The CPU kernels we ship as source (`models/layers/attention/backends/paged_decode.c`,
`models/layers/cpu_sgemm.c`, `models/layers/cpu_ops.c`, and the communicator's
`distributed/device_communicators/shm_allreduce.c`; this module sits at the bottom of
the layering so that both can use it) come without a build step at install time: a wheel cannot know the CPU it will run
on, and `-march=native` is where their speed comes from. The first process that needs
one compiles it with the system's C compiler (`$CC`, default `cc`) into
`$TP_RUNTIME_CACHE/kernels/` (default `~/.cache/tp-runtime`), keyed by the source, the
compiler, the flags and the CPU's feature flags; later processes only load it (a few
ms). torch's cpp_extension would need a C++ toolchain, ninja and Python headers for what
is one C file and one ctypes call.

Called by each kernel's loader on every rank (each loads the same file; two ranks
building at once each write their own temporary directory and rename into place). A
library that does not load is never cached, and a failed build leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from distributed.native_calls import NativeLibrary

logger = logging.getLogger(__name__)

_BUILD_TIMEOUT_S = 120
#: One value's bfloat16 <-> float32 conversion, as torch does it, shared by the C kernels
#: that read or write bfloat16 (models' and the shm all-reduce's): each names it in the
#: sources it hands `load_kernel`, so that a change to it rebuilds them.
BF16_CONVERT_H = Path(__file__).with_name("bf16_convert.h")
#: The same for float16 (fp16_convert.h), in the sources of the kernels that read or write it.
FP16_CONVERT_H = Path(__file__).with_name("fp16_convert.h")
T = TypeVar("T")


def kernels_dir() -> Path:
    # The root is engine.entrypoints.demo_model.cache_root's (not importable from here).
    root = os.environ.get("TP_RUNTIME_CACHE") or Path.home() / ".cache" / "tp-runtime"
    return Path(root) / "kernels"


@functools.cache
def cpu_flags() -> str:
    """The CPU's feature flags line (/proc/cpuinfo), or the processor name; read once per
    process (every kernel's cache key and CPU check asks for it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler_identity(compiler: str) -> str:
    """The compiler's resolved file, size and mtime: changes when it is replaced or
    upgraded, and costs a stat where `cc --version` cost a process (every rank, every
    start). Raises FileNotFoundError for a compiler that is not there."""
    found = shutil.which(compiler)
    if found is None:
        raise FileNotFoundError(f"no C compiler {compiler!r} on PATH (set CC)")
    real = os.path.realpath(found)
    st = os.stat(real)
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def _sources(source: Path | Sequence[Path]) -> list[Path]:
    """A kernel's files: one C file, or several (C files compiled and linked into one
    library, and the headers they include, which only enter the cache key)."""
    return [source] if isinstance(source, Path) else list(source)


def _build(compiler: str, sources: list[Path], compile_flags: Sequence[str], link_flags: Sequence[str],
           link_libs: Sequence[str], check: Callable[[ctypes.CDLL], object], target: Path) -> None:
    """Compile the C files of `sources` into `target` via a private temporary directory
    beside it, load and `check` it there, then rename (atomic: a concurrent reader sees no
    file or the whole new one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    try:
        c_files = [src for src in sources if src.suffix == ".c"]
        objs, lib = [work / f"{i}-{src.stem}.o" for i, src in enumerate(c_files)], work / f"{c_files[0].stem}.so"
        cmds = [[compiler, *compile_flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(c_files, objs)]
        for cmd in [*cmds, [compiler, *link_flags, *map(str, objs), *link_libs, "-o", str(lib)]]:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
            if proc.returncode != 0:
                raise OSError(f"`{' '.join(cmd)}` exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        check(ctypes.CDLL(str(lib)))
        os.replace(lib, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_or_load_library(source: Path | Sequence[Path], compile_flags: Sequence[str], link_flags: Sequence[str],
                          link_libs: Sequence[str], check: Callable[[ctypes.CDLL], object]
                          ) -> tuple[ctypes.CDLL, Path]:
    """The library built from `source` (one C file, or C files and their headers, named
    by the first) for this machine, and its path: loaded from the
    cache, or compiled first. `check(lib)` must raise (AttributeError for a missing
    symbol, OSError) if a freshly built library is unusable. Raises OSError (no
    compiler, a failed compile or load), subprocess.SubprocessError (a compiler that
    hangs) or what `check` raises; the caller decides the fallback."""
    compiler = os.environ.get("CC") or "cc"
    identity = _compiler_identity(compiler)
    sources = _sources(source)
    key = hashlib.sha256("\0".join([*(src.read_text() for src in sources), identity, *compile_flags, *link_flags,
                                    *link_libs, platform.machine(), cpu_flags()]).encode()).hexdigest()[:16]
    target = kernels_dir() / f"{sources[0].stem}-{key}.so"
    if not target.is_file():
        _build(compiler, sources, compile_flags, link_flags, link_libs, check, target)
    return ctypes.CDLL(str(target)), target


def load_kernel(source: Path | Sequence[Path], compile_flags: Sequence[str], link_flags: Sequence[str], link_libs: Sequence[str],
                wrap: Callable[[NativeLibrary, Path], T], unavailable: str, switch: str | None = None) -> T | None:
    """`wrap(library, path)` for the library built from `source` (`build_or_load_library`;
    `wrap` also checks a fresh build; its functions are `NativeFunction`s, which a CPU
    graph can record: native_calls.py), or None where it cannot be built or loaded, logged
    as the warning `unavailable` with the reason in its one %s. None, with nothing built,
    when the environment variable `switch` is "0" (read on each call)."""
    if switch is not None and os.environ.get(switch, "1") == "0":
        return None
    try:
        lib, path = build_or_load_library(source, compile_flags, link_flags, link_libs,
                                          lambda lib: wrap(NativeLibrary(lib), Path()))
        return wrap(NativeLibrary(lib), path)
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        logger.warning(unavailable, e)
        return None
