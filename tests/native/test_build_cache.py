"""The native runtime's build is kept in mobilec's cache and copied from there when nothing it is built from
changed (compiler/artifacts/native_runtime.py): the same files, no compiler run; other flags or sources build again."""

import filecmp
import shutil
import stat

import pytest

from compiler.artifacts import native_runtime
from compiler.artifacts.native_runtime import LIBRARY_NAME, RUNNER_NAME, build_runtime
from compiler.errors import MobilecError
from tests.native.conftest import COMPILER

pytestmark = pytest.mark.skipif(shutil.which(COMPILER) is None, reason=f"no C++ compiler ({COMPILER})")


def _compiler_runs(monkeypatch) -> list[int]:
    """Counts build_runtime's compiler runs (one entry per batch of side-by-side commands)."""
    runs = []
    run_compilers = native_runtime._run_compilers  # pylint: disable=protected-access

    def counted(commands):
        runs.append(len(commands))
        return run_compilers(commands)

    monkeypatch.setattr(native_runtime, "_run_compilers", counted)
    return runs


def test_a_second_build_is_copied_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOBILEC_CACHE_DIR", str(tmp_path / "cache"))
    runs = _compiler_runs(monkeypatch)
    first = build_runtime(tmp_path / "first", compiler=COMPILER)
    assert runs == [5, 1, 1]  # the sources side by side, then the library, then the runner
    second = build_runtime(tmp_path / "second", compiler=COMPILER)
    assert runs == [5, 1, 1]  # copied
    for name in (f"bin/{RUNNER_NAME}", f"lib/{LIBRARY_NAME}", "include/mobilec.h", "lib/libtvm_runtime.so"):
        assert filecmp.cmp(first.root / name, second.root / name, shallow=False), name
    assert second.runner.stat().st_mode & stat.S_IXUSR
    assert sorted(p.relative_to(second.root) for p in second.root.rglob("*")) == sorted(
        p.relative_to(first.root) for p in first.root.rglob("*"))


def test_other_flags_sources_or_compilers_are_other_entries(tmp_path, monkeypatch):
    libraries = native_runtime.host_tvm_libraries()
    flags = list(native_runtime.CXX_FLAGS)
    entry = native_runtime._cache_entry(COMPILER, flags, libraries)  # pylint: disable=protected-access
    assert entry == native_runtime._cache_entry(COMPILER, list(flags), libraries)  # pylint: disable=protected-access
    assert entry != native_runtime._cache_entry(COMPILER, [*flags, "-DX=1"], libraries)  # pylint: disable=protected-access
    assert entry != native_runtime._cache_entry("aarch64-linux-gnu-g++", flags, libraries)  # pylint: disable=protected-access
    sources = tmp_path / "runtime"
    shutil.copytree(native_runtime.SOURCE_DIR, sources)
    monkeypatch.setattr(native_runtime, "SOURCE_DIR", sources)
    assert entry == native_runtime._cache_entry(COMPILER, flags, libraries)  # pylint: disable=protected-access
    with (sources / "runner.cc").open("a") as f:
        f.write("\n")
    assert entry != native_runtime._cache_entry(COMPILER, flags, libraries)  # pylint: disable=protected-access


def test_a_failed_build_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MOBILEC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(MobilecError, match=r"failed on mobilec_api\.cc: .*missing\.h"):
        build_runtime(tmp_path / "out", compiler=COMPILER, extra_flags=("-include", str(tmp_path / "missing.h")))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("cache/**/*.so"))


def test_a_missing_compiler_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MOBILEC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(MobilecError, match=r"the C\+\+ compiler no-such-g\+\+ is missing: install it"):
        build_runtime(tmp_path / "out", compiler="no-such-g++")
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
