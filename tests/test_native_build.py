"""`distributed/native_build.py` with a kernel of several files: C files compiled and
linked into one library, a header they include in the cache key."""

from __future__ import annotations

import ctypes

from distributed.native_build import build_or_load_library


def _check(lib: ctypes.CDLL) -> None:
    lib.twice_plus  # noqa: B018 - AttributeError when the symbol is missing


def test_c_files_are_linked_together_and_a_header_change_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path / "cache"))
    header, main, helper = tmp_path / "k.h", tmp_path / "k_main.c", tmp_path / "k_helper.c"
    header.write_text("#define PLUS 1\nint twice(int x);\n")
    main.write_text('#include "k.h"\nint twice_plus(int x) { return twice(x) + PLUS; }\n')
    helper.write_text("int twice(int x) { return 2 * x; }\n")
    sources = (main, helper, header)
    flags, link = ("-O2", "-fPIC"), ("-shared",)
    lib, first = build_or_load_library(sources, flags, link, (), _check)
    assert lib.twice_plus(20) == 41
    assert first.name.startswith("k_main-") and first.is_file()
    again, same = build_or_load_library(sources, flags, link, (), _check)
    assert same == first  # cached: loaded, not built
    header.write_text("#define PLUS 2\nint twice(int x);\n")
    rebuilt, second = build_or_load_library(sources, flags, link, (), _check)
    assert second != first and rebuilt.twice_plus(20) == 42
