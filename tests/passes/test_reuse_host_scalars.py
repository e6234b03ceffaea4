"""ReuseHostScalars: IR in/IR out (a host scalar computed twice, then once), functions kept apart, and the
launches it saves in a lowered model."""

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.commands.inspect_ir import kernel_launches
from compiler.passes.reuse_host_scalars import ReuseHostScalars


@I.ir_module
class _Before:
    @T.prim_func
    def scale() -> T.float64:
        T.func_attr({"tirx.is_host_func": True})
        return T.float64(0.125)

    @R.function(pure=False)
    def decode(x: R.Tensor((4,), "float32")):
        cls = _Before
        a: R.Prim("float64") = cls.scale()
        _1: R.Any = R.call_packed("vm.builtin.attention_kv_cache_attention_with_fused_qkv", x, a)
        b: R.Prim("float64") = cls.scale()
        _2: R.Any = R.call_packed("vm.builtin.attention_kv_cache_attention_with_fused_qkv", x, b)
        return x

    @R.function(pure=False)
    def prefill(x: R.Tensor((4,), "float32")):
        cls = _Before
        c: R.Prim("float64") = cls.scale()
        _3: R.Any = R.call_packed("vm.builtin.attention_kv_cache_attention_with_fused_qkv", x, c)
        return x


@I.ir_module
class _Expected:
    @T.prim_func
    def scale() -> T.float64:
        T.func_attr({"tirx.is_host_func": True})
        return T.float64(0.125)

    @R.function(pure=False)
    def decode(x: R.Tensor((4,), "float32")):
        cls = _Expected
        a: R.Prim("float64") = cls.scale()
        _4: R.Any = R.call_packed("vm.builtin.attention_kv_cache_attention_with_fused_qkv", x, a)
        _5: R.Any = R.call_packed("vm.builtin.attention_kv_cache_attention_with_fused_qkv", x, a)
        return x

    @R.function(pure=False)
    def prefill(x: R.Tensor((4,), "float32")):
        cls = _Expected
        c: R.Prim("float64") = cls.scale()
        _6: R.Any = R.call_packed("vm.builtin.attention_kv_cache_attention_with_fused_qkv", x, c)
        return x


def test_a_host_scalar_is_computed_once_per_function():
    after = ReuseHostScalars()(_Before)
    tvm.ir.assert_structural_equal(after, _Expected)
    assert (kernel_launches(_Before), kernel_launches(after), kernel_launches(after, "prefill")) == (4, 3, 2)
