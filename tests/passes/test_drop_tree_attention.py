"""DropTreeAttention: IR in/IR out (the cache's tree-mask kernels become empty entries and leave the module, the
others stay), a call of another function left alone, and the Llama-3-8B-shaped GPU build it makes possible."""

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.codegen import pipeline
from compiler.model_import.importer import import_model, open_model
from compiler.passes.drop_tree_attention import DropTreeAttention
from compiler.target.build_plan import resolve_plan
from tests.helpers.real_shapes import write_config


@I.ir_module
class _Before:
    @T.prim_func
    def batch_decode_paged_kv_cpu(x: T.Buffer((4,), "float32")):
        x[0] = T.float32(1)

    @T.prim_func
    def batch_tree_attn(x: T.Buffer((4,), "float32")):
        x[1] = T.float32(1)

    @T.prim_func
    def tree_attn_paged_kv_cpu(x: T.Buffer((4,), "float32")):
        x[2] = T.float32(1)

    @R.function
    def create_tir_paged_kv_cache() -> R.Any:
        cls = _Before
        cache: R.Any = R.call_pure_packed(
            "vm.builtin.paged_attention_kv_cache_create", (R.str("tirx"), cls.batch_decode_paged_kv_cpu),
            (R.str("tirx"), cls.batch_tree_attn), (R.str("tirx"), cls.tree_attn_paged_kv_cpu), R.tuple(),
            ty_args=(R.Any,))
        return cache


@I.ir_module
class _Expected:
    @T.prim_func
    def batch_decode_paged_kv_cpu(x: T.Buffer((4,), "float32")):
        x[0] = T.float32(1)

    @R.function
    def create_tir_paged_kv_cache() -> R.Any:
        cls = _Expected
        cache: R.Any = R.call_pure_packed(
            "vm.builtin.paged_attention_kv_cache_create", (R.str("tirx"), cls.batch_decode_paged_kv_cpu),
            R.tuple(), R.tuple(), R.tuple(), ty_args=(R.Any,))
        return cache


def test_tree_kernels_leave_the_create_call_and_the_module():
    tvm.ir.assert_structural_equal(DropTreeAttention()(_Before), _Expected)


@I.ir_module
class _OtherCall:
    @T.prim_func
    def batch_tree_attn(x: T.Buffer((4,), "float32")):
        x[1] = T.float32(1)

    @R.function
    def main() -> R.Any:
        cls = _OtherCall
        out: R.Any = R.call_pure_packed("vm.builtin.something_else", (R.str("tirx"), cls.batch_tree_attn),
                                        ty_args=(R.Any,))
        return out


def test_another_call_keeps_its_kernels():
    tvm.ir.assert_structural_equal(DropTreeAttention()(_OtherCall), _OtherCall)


@pytest.mark.parametrize("drop", [True, False])
def test_llama3_8b_shape_builds_for_adreno_only_without_them(tmp_path, monkeypatch, drop):
    """TVM 0.27's CSE fails on TVM's tree-attention kernel with Llama 3 RoPE (32 query heads over 8 KV heads) for
    OpenCL; with the kernel kept the build fails again, in one line naming the kernel and the target."""
    if not drop:
        steps = pipeline.steps
        monkeypatch.setattr(pipeline, "steps", lambda *a, **k: [s for s in steps(*a, **k)
                                                                 if s[0] != "drop-tree-attention"])
    plan = resolve_plan("android-adreno")
    with open_model(str(write_config("llama-3-8b", tmp_path / "m")), weights_required=False) as ckpt:
        mod = import_model(ckpt, plan, None).mod
    if drop:
        pipeline.build(mod, plan)
        return
    with pytest.raises(pipeline.InternalCompilerError) as err:
        pipeline.build(mod, plan)
    message = str(err.value)
    assert "\n" not in message and "kernel batch_tree_attn" in message and "target android-adreno" in message
    assert "used before definition" in message
