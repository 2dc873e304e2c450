"""tools/soak.py's allocator reading (no vLLM): `heap_mib` must see a malloc and its free, or the soak's
`heap_in_use_mib` column could not tell a leak from allocator retention."""

from __future__ import annotations

import ctypes

from tools.soak import _LIBC, heap_mib, rss_mib


def test_heap_mib_counts_a_malloc_until_it_is_freed() -> None:
    _LIBC.malloc.restype = ctypes.c_void_p
    _LIBC.malloc.argtypes = [ctypes.c_size_t]
    _LIBC.free.argtypes = [ctypes.c_void_p]
    in_use0, _ = heap_mib()
    ptr = _LIBC.malloc(64 << 20)  # above glibc's mmap threshold: an mmapped chunk, counted in hblkhd
    assert ptr
    try:
        in_use1, _ = heap_mib()
    finally:
        _LIBC.free(ptr)
    in_use2, _ = heap_mib()
    assert 63.9 <= in_use1 - in_use0 <= 65  # other threads (none here) aside, exactly the 64 MiB asked for
    assert abs(in_use2 - in_use0) < 1
    assert rss_mib() > 0


def test_engine_soak_cli_reports_the_heap_every_n_steps() -> None:
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    import torch  # noqa: F401  (the native modules need torch loaded first)

    pytest.importorskip("activekv._backend")
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "tools.engine_soak", "--mode", "compressed", "--steps", "20",
                          "--every", "10"], cwd=repo, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [dict(kv.split("=") for kv in line.split()) for line in out.splitlines()]
    assert [r["step"] for r in rows] == ["0", "10", "20"]
    assert all(r["mode"] == "compressed" and float(r["heap_in_use_mib"]) > 0 for r in rows)
