"""MarkNoalias: every PrimFunc leaves the pipeline noalias (TVM's codegen takes the last kernel's setting for all)."""

import tvm
from tvm import tirx
from tvm.script import tirx as T

from compiler.codegen import pipeline
from compiler.loaders import open_checkpoint
from compiler.model_import.importer import import_model
from compiler.passes.mark_noalias import MarkNoalias
from compiler.target.build_plan import resolve_plan
from tests.helpers.tiny_models import build_model, save_hf


@T.prim_func(private=True)
def _copy(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
    for i in range(8):
        b[i] = a[i]


def _noalias(func) -> bool:
    return bool(func.attrs is not None and func.attrs.get("tirx.noalias"))


def test_marks_only_what_lacks_it():
    marked = _copy.with_attr("tirx.noalias", True).with_attr("keep", 1)
    before = tvm.IRModule({"plain": _copy, "marked": marked})
    mod = MarkNoalias()(before)
    assert not _noalias(before["plain"])  # the input module is left as it was
    assert _noalias(mod["plain"]) and _noalias(mod["marked"]) and int(mod["marked"].attrs["keep"]) == 1


def test_every_kernel_of_a_compiled_model_is_noalias(tmp_path):
    """TVM's KV-cache kernels and the shape functions the lowering adds come without it; after the pipeline none
    lacks it, and without the step some do (the negative control: the step is what sets them)."""
    save_hf(build_model("llama_gqa"), tmp_path / "hf")
    plan = resolve_plan("host", "q4f16_g32")
    with open_checkpoint(tmp_path / "hf") as ckpt:
        mod = import_model(ckpt, plan, 64).mod
    seen = {}
    pipeline.run_steps(mod, plan, lambda _i, name, m: seen.__setitem__(name, m))
    before = [gv.name_hint for gv, f in seen["plan-memory-and-lower"].functions_items()
              if isinstance(f, tirx.PrimFunc) and not _noalias(f)]
    assert "compact_kv_copy_cpu" in before and any(n.startswith("shape_func") for n in before)
    assert all(_noalias(f) for f in seen["mark-noalias"].functions.values() if isinstance(f, tirx.PrimFunc))


@T.prim_func(private=True)
def _copy_noalias(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
    T.func_attr({"tirx.noalias": True})
    for i in range(8):
        b[i] = a[i]


def test_ir_in_ir_out():
    tvm.ir.assert_structural_equal(MarkNoalias()(tvm.IRModule({"plain": _copy})),
                                   tvm.IRModule({"plain": _copy_noalias}))
