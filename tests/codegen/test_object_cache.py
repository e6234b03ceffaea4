"""object_cache: a CPU kernel's object is built once and linked by later builds of the same kernel, target and
settings (in this process or another); a changed kernel, symbol or target gets its own; the library computes what
the kernels say; a cache that cannot be written builds as before; the least recently used objects are trimmed."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import relax, te
from tvm.script import relax as R

from compiler.codegen import object_cache

HOST = tvm.target.Target({"kind": "llvm"})
X86_64_V3 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell"})


def _module(addend: float, name: str = "add_const"):
    """A Relax function calling one kernel, y = x + addend, lowered for the VM."""

    x = te.placeholder((8,), "float32", name="x")
    kernel = te.create_prim_func([x, te.compute((8,), lambda i: x[i] + tvm.tirx.const(addend, "float32"), name="y")])

    builder = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor((8,), "float32"))
    with builder.function("main", [x]):
        gv = builder.add_func(kernel.with_attr("global_symbol", name), name)
        out = builder.emit(relax.call_tir(gv, [x], R.Tensor((8,), "float32")))
        builder.emit_func_output(out)
    with HOST:
        return relax.get_pipeline("default")(builder.get())


def _objects(cache_dir):
    return sorted((cache_dir / "objects").rglob("*.o"))


def _run(mod, target, tmp_path):
    library = tmp_path / f"lib{len(list(tmp_path.glob('lib*.so')))}.so"
    tvm.compile(object_cache.as_objects(mod, target, {}), target=target, relax_pipeline=None).export_library(
        str(library))
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(np.arange(8, dtype="float32"))).numpy()


@pytest.fixture(name="cache_dir")
def fixture_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOBILEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_kernel_is_built_once_and_its_object_computes_it(cache_dir, tmp_path, monkeypatch):
    np.testing.assert_array_equal(_run(_module(1.0), HOST, tmp_path), np.arange(8) + 1.0)
    (kept,) = _objects(cache_dir)
    built, build = [], tvm.tirx.build
    monkeypatch.setattr(tvm.tirx, "build", lambda mod, **k: built.extend(gv.name_hint for gv in mod.get_global_vars())
                        or build(mod, **k))
    np.testing.assert_array_equal(_run(_module(1.0), HOST, tmp_path), np.arange(8) + 1.0)
    assert built == [object_cache.ANCHOR] and _objects(cache_dir) == [kept]  # the library's empty kernel only
    # another process links the same object without building it
    script = ("import sys, tvm\n"
              "from compiler.codegen import object_cache\n"
              "from tests.codegen.test_object_cache import HOST, _module\n"
              "tvm.tirx.build = lambda *a, **k: sys.exit('built again')\n"
              "object_cache.as_objects(_module(1.0), HOST, {})\n")
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "MOBILEC_CACHE_DIR": str(cache_dir)})
    assert _objects(cache_dir) == [kept]


def test_a_changed_kernel_symbol_or_target_gets_its_own_object(cache_dir, tmp_path):
    np.testing.assert_array_equal(_run(_module(1.0), HOST, tmp_path), np.arange(8) + 1.0)
    np.testing.assert_array_equal(_run(_module(2.0), HOST, tmp_path), np.arange(8) + 2.0)  # not the kept 1.0
    assert len(_objects(cache_dir)) == 2
    np.testing.assert_array_equal(_run(_module(1.0, "add_one"), HOST, tmp_path), np.arange(8) + 1.0)
    assert len(_objects(cache_dir)) == 3
    object_cache.as_objects(_module(1.0), X86_64_V3, {})
    assert len(_objects(cache_dir)) == 4
    object_cache.as_objects(_module(1.0), HOST, {"max_alloc_gb": 1})  # other limits to verify
    assert len(_objects(cache_dir)) == 5


def test_a_cache_that_cannot_be_written_builds_as_before(monkeypatch, tmp_path):
    monkeypatch.setenv("MOBILEC_CACHE_DIR", "/proc/no-such-cache")
    mod = _module(3.0)
    assert object_cache.as_objects(mod, HOST, {}).same_as(mod)
    np.testing.assert_array_equal(_run(mod, HOST, tmp_path), np.arange(8) + 3.0)


def test_the_least_recently_used_objects_are_trimmed(cache_dir, monkeypatch):
    object_cache.as_objects(_module(1.0), HOST, {})
    (first,) = _objects(cache_dir)
    os.utime(first, (1, 1))  # long unused
    other_toolchains = [cache_dir / "objects" / f"tvm-old-{i}" for i in range(object_cache.KEPT_TOOLCHAINS + 1)]
    for i, folder in enumerate(other_toolchains):
        folder.mkdir(parents=True)
        os.utime(folder, (i + 1, i + 1))
    monkeypatch.setattr(object_cache, "KEPT_BYTES", first.stat().st_size * 3 // 2)
    object_cache.as_objects(_module(2.0), HOST, {})
    (second,) = _objects(cache_dir)
    assert second != first
    assert [folder.exists() for folder in other_toolchains] == [False, True, True]
