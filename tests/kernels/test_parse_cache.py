"""parse_cache: a kept kernel is the kernel the factory parses (in this process and loaded from disk in another),
other arguments get their own, arguments without a stable key are parsed every time, and a change to a source file
starts a new set."""

import os
import subprocess
import sys

import pytest
import tvm
from tvm import tirx

from compiler.kernels import integer_dot_gemv, kv_append, parse_cache

SHAPE = integer_dot_gemv.GemvShape(n=64, k=128, bits=4, group=32, symmetric=True, scale_dtype="float16",
                                   act_bits=8, family="avx2")


@pytest.fixture(name="cache_dir")
def fixture_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOBILEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(parse_cache, "_MEMORY", {})
    return tmp_path


def _kept_files(cache_dir):
    return sorted((cache_dir / "kernels").rglob("*.json"))


def test_kept_kernel_equals_the_parsed_one_here_and_in_another_process(cache_dir):
    parsed = integer_dot_gemv.gemv.__wrapped__(SHAPE, (1, 1, 64))
    first = integer_dot_gemv.gemv(SHAPE, (1, 1, 64))
    tvm.ir.assert_structural_equal(first, parsed)
    assert integer_dot_gemv.gemv(SHAPE, (1, 1, 64)).same_as(first)  # the process's memo
    (kept,) = _kept_files(cache_dir)
    parse_cache._MEMORY.clear()  # pylint: disable=protected-access
    loaded = integer_dot_gemv.gemv(SHAPE, (1, 1, 64))
    assert not loaded.same_as(first)
    tvm.ir.assert_structural_equal(loaded, parsed)
    # another process loads the same file: its factory, made to fail, is never called
    script = ("from compiler.kernels import integer_dot_gemv as g\n"
              "g.gemv.__wrapped__.__code__ = (lambda *a: 1 / 0).__code__\n"
              f"print(g.gemv(g.{SHAPE!r}, (1, 1, 64)).script())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "MOBILEC_CACHE_DIR": str(cache_dir)})
    assert out.stdout.strip() == parsed.script().strip()
    assert _kept_files(cache_dir) == [kept]


def test_other_arguments_get_their_own_kernel(cache_dir):
    a = kv_append.kv_append(2, 16, 16, "float16")
    b = kv_append.kv_append(2, 16, 16, "float32")
    c = kv_append.kv_append(kv_heads=2, head_dim=16, page_size=16, dtype="float16")  # keywords: another key
    assert a.script() != b.script()
    tvm.ir.assert_structural_equal(a, c)
    assert len(_kept_files(cache_dir)) == 3


def test_arguments_without_a_stable_key_are_parsed_every_time(cache_dir):
    calls = []
    factory = parse_cache.cached(lambda shape: calls.append(shape) or kv_append.kv_append.__wrapped__(2, 16, 16,
                                                                                                    "float16"))
    rows = tirx.Var("rows", "int64")
    factory((rows, 16))
    factory((rows, 16))
    assert len(calls) == 2 and not _kept_files(cache_dir)
    factory((4, 16))
    factory((4, 16))
    assert len(calls) == 3 and len(_kept_files(cache_dir)) == 1


def test_a_changed_source_starts_a_new_set(tmp_path, monkeypatch):
    package = tmp_path / "compiler"
    package.mkdir()
    (package / "kernel.py").write_text("ROWS = 16\n")
    monkeypatch.setattr(parse_cache, "_PACKAGE", package)
    parse_cache.fingerprint.cache_clear()
    try:
        before = parse_cache.fingerprint()
        (package / "kernel.py").write_text("ROWS = 32\n")
        parse_cache.fingerprint.cache_clear()
        assert parse_cache.fingerprint() != before
    finally:
        parse_cache.fingerprint.cache_clear()


def test_old_sets_beyond_the_kept_number_are_deleted(cache_dir):
    kernels = cache_dir / "kernels"
    for i in range(parse_cache.KEPT_SETS + 2):
        (kernels / f"old{i}").mkdir(parents=True)
        os.utime(kernels / f"old{i}", (i, i))
    kv_append.kv_append(2, 16, 16, "float16")
    sets = sorted(p.name for p in kernels.iterdir())
    assert len(sets) == parse_cache.KEPT_SETS and parse_cache.fingerprint() in sets
    assert "old0" not in sets and f"old{parse_cache.KEPT_SETS + 1}" in sets
