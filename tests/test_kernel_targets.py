"""Every CPU kernel library compiles for the x86 CPUs it may be built on, not only this one.

The loader compiles each library for the machine it runs on (`-march=native`), and the
suite runs on whatever CPU CI has: an AVX2 VM, where the kernels' AVX-512 paths (VNNI,
BF16) are never compiled. An intrinsic from an extension a target lacks would then fail
only on users' machines, as a logged warning and a slow fallback: gguf_vnni.c used AVX-512
VBMI's byte permute on the Cascade Lake path (VNNI without VBMI) until 2026-12-06. Each C
file of each library is compiled here (not linked, not run: this CPU may not run the
code) with the library's own flags and `-march` set to each target, at -O0 (the ISA
checks are the compiler's at every level).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from distributed.device_communicators import shm_allreduce
from models.layers import cpu_bf16_gemm, cpu_ops, cpu_sgemm
from models.layers.attention.backends import paged_decode
from models.layers.fused_moe import cpu_moe, router
from models.layers.quantization import fp8_kernels, gguf_kernels, int8_gemm
from models.layers.quantization.kernels import wna16_cpu

COMPILER = os.environ.get("CC") or "cc"
pytestmark = pytest.mark.skipif(shutil.which(COMPILER) is None or os.uname().machine != "x86_64",
                                reason="needs a C compiler targeting x86-64")

#: -march targets: AVX2 (Haswell, Zen 2/3), AVX-512 without VNNI (Skylake-X), with VNNI and
#: no VBMI (Cascade Lake), with VBMI (Ice Lake), with BF16 and AMX (Sapphire Rapids).
TARGETS = ["haswell", "skylake-avx512", "cascadelake", "icelake-server", "sapphirerapids"]
#: Each library's sources and flags; the one built only with AVX-512 BF16 is compiled for
#: the targets that have it.
LIBRARIES = {
    "gguf_kernels": (gguf_kernels.SOURCES, gguf_kernels.COMPILE_FLAGS, TARGETS),
    "cpu_ops": (cpu_ops.SOURCES, cpu_ops.COMPILE_FLAGS, TARGETS),
    "topk_softmax": (router.SOURCES, router.COMPILE_FLAGS, TARGETS),
    "cpu_moe": (cpu_moe.SOURCES, cpu_moe.COMPILE_FLAGS, TARGETS),
    "fp8_kernels": (fp8_kernels.SOURCES, fp8_kernels.COMPILE_FLAGS, TARGETS),
    "wna16_cpu": (wna16_cpu.SOURCES, wna16_cpu.COMPILE_FLAGS, TARGETS),
    "int8_gemm": (int8_gemm.SOURCES, int8_gemm.COMPILE_FLAGS, TARGETS),
    "cpu_sgemm": (cpu_sgemm.SOURCES, cpu_sgemm.COMPILE_FLAGS, TARGETS),
    "paged_decode": (paged_decode.SOURCES, paged_decode.COMPILE_FLAGS, TARGETS),
    "shm_allreduce": ((shm_allreduce.KERNEL_SOURCE,), shm_allreduce.KERNEL_COMPILE_FLAGS, TARGETS),
    "cpu_bf16_gemm": (cpu_bf16_gemm.SOURCES, cpu_bf16_gemm.COMPILE_FLAGS, ["sapphirerapids"]),
}


def _compile(source: Path, flags: tuple[str, ...], target: str, out: Path) -> subprocess.CompletedProcess:
    flags = tuple("-O0" if f.startswith("-O") else f"-march={target}" if f == "-march=native" else f for f in flags)
    return subprocess.run([COMPILER, *flags, "-c", str(source), "-o", str(out)], capture_output=True, text=True,
                          timeout=120)


@functools.cache
def _compiler_knows(target: str) -> bool:
    return subprocess.run([COMPILER, f"-march={target}", "-x", "c", "-E", "-o", os.devnull, os.devnull],
                          capture_output=True, timeout=60).returncode == 0


@pytest.mark.parametrize("library,target", [(lib, t) for lib, (_, _, targets) in LIBRARIES.items() for t in targets])
def test_library_compiles_for_the_target(library: str, target: str, tmp_path: Path) -> None:
    if not _compiler_knows(target):
        pytest.skip(f"{COMPILER} does not know -march={target}")
    sources, flags, _ = LIBRARIES[library]
    c_files = [Path(s) for s in sources if str(s).endswith(".c")]
    assert c_files, library
    failures = []
    for source in c_files:
        proc = _compile(source, flags, target, tmp_path / f"{source.stem}.o")
        if proc.returncode:
            failures.append(f"{source.name} for -march={target}:\n{proc.stderr[-2000:]}")
    assert not failures, "\n".join(failures)
