"""FuseGEMMNorms: IR in/IR out (Before/Expected) for the RMSNorm before a prefill GEMM, the kernels it must leave
alone (negative controls), the GPU Matmul rule on the fused kernel (each thread reduces the rows it multiplies), and
its numerics on this machine's OpenCL against numpy over more rows than one work group's tile, with and without a
norm over each head of the GEMM's columns after it (Qwen3's q/k norm)."""

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir
from tvm.s_tir import dlight
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.passes.fuse_gemm_norms import FuseGEMMNorms
from compiler.passes.ir_walk import tir_statements
from compiler.runtime import opencl_device
from compiler.schedules import gpu as gpu_schedules
from compiler.target.targets import load_target
from tests.helpers.pocl_device import NEEDS_OPENCL


@I.ir_module
class _Before:
    """norm (a row reduction over each of the sequence's rows, read only by the projection) -> projection (reads a
    2-D weight), each kernel with its own length variable."""

    @T.prim_func(private=True, s_tir=True)
    def norm(var_x: T.handle, w: T.Buffer((8,), "float32"), var_y: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, 8))
        y = T.match_buffer(var_y, (n, 8))
        sum_sq = T.sblock_alloc_buffer((n,))
        for r, k in T.grid(n, 8):
            with T.sblock("sum_sq"):
                vr, vk = T.axis.remap("SR", [r, k])
                with T.init():
                    sum_sq[vr] = T.float32(0)
                sum_sq[vr] = sum_sq[vr] + x[vr, vk] * x[vr, vk]
        for r, i in T.grid(n, 8):
            with T.sblock("norm"):
                vr, vi = T.axis.remap("SS", [r, i])
                y[vr, vi] = x[vr, vi] * T.rsqrt(sum_sq[vr]) * w[vi]

    @T.prim_func(private=True, s_tir=True)
    def gemm(var_x: T.handle, w: T.Buffer((4, 8), "float32"), var_y: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 8))
        y = T.match_buffer(var_y, (m, 4))
        for r, c, k in T.grid(m, 4, 8):
            with T.sblock("gemm"):
                vr, vc, vk = T.axis.remap("SSR", [r, c, k])
                with T.init():
                    y[vr, vc] = T.float32(0)
                y[vr, vc] = y[vr, vc] + w[vc, vk] * x[vr, vk]

    @R.function
    def prefill(x: R.Tensor(("seq_len", 8), "float32"), params: R.Tuple(R.Tensor((8,), "float32"),
                                                                         R.Tensor((4, 8), "float32"))):
        seq_len = T.int64()
        cls = _Before
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            h = R.call_tir(cls.norm, (x, w_norm), out_ty=R.Tensor((seq_len, 8), "float32"))
            y = R.call_tir(cls.gemm, (h, w_proj), out_ty=R.Tensor((seq_len, 4), "float32"))
            R.output(y)
        return y


@I.ir_module
class _Expected:
    """One kernel in the norm's length variable: the norm's blocks, its result a buffer of the kernel's own, then
    the projection's."""

    @T.prim_func(private=True, s_tir=True)
    def gemm_after_norm(var_x: T.handle, w: T.Buffer((8,), "float32"), w_1: T.Buffer((4, 8), "float32"),
                        var_y: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, 8))
        y = T.match_buffer(var_y, (n, 4))
        y_1 = T.sblock_alloc_buffer((n, 8))
        sum_sq = T.sblock_alloc_buffer((n,))
        for r, k in T.grid(n, 8):
            with T.sblock("sum_sq"):
                vr, vk = T.axis.remap("SR", [r, k])
                with T.init():
                    sum_sq[vr] = T.float32(0)
                sum_sq[vr] = sum_sq[vr] + x[vr, vk] * x[vr, vk]
        for r, i in T.grid(n, 8):
            with T.sblock("norm"):
                vr, vi = T.axis.remap("SS", [r, i])
                y_1[vr, vi] = x[vr, vi] * T.rsqrt(sum_sq[vr]) * w[vi]
        for r, c, k in T.grid(n, 4, 8):
            with T.sblock("gemm"):
                vr, vc, vk = T.axis.remap("SSR", [r, c, k])
                with T.init():
                    y[vr, vc] = T.float32(0)
                y[vr, vc] = y[vr, vc] + w_1[vc, vk] * y_1[vr, vk]

    @R.function
    def prefill(x: R.Tensor(("seq_len", 8), "float32"), params: R.Tuple(R.Tensor((8,), "float32"),
                                                                         R.Tensor((4, 8), "float32"))):
        seq_len = T.int64()
        cls = _Expected
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            y = R.call_tir(cls.gemm_after_norm, (x, w_norm, w_proj), out_ty=R.Tensor((seq_len, 4), "float32"))
            R.output(y)
        return y


@I.ir_module
class _Apart:
    """Negative controls. shared: the normed rows are also a result of the function; decode: one row of fixed shape
    (FuseGEMVNorms' kind); elementwise: a producer that reduces nothing (SwiGLU's kind)."""

    @T.prim_func(private=True, s_tir=True)
    def norm(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, 8))
        y = T.match_buffer(var_y, (n, 8))
        sum_sq = T.sblock_alloc_buffer((n,))
        for r, k in T.grid(n, 8):
            with T.sblock("sum_sq"):
                vr, vk = T.axis.remap("SR", [r, k])
                with T.init():
                    sum_sq[vr] = T.float32(0)
                sum_sq[vr] = sum_sq[vr] + x[vr, vk] * x[vr, vk]
        for r, i in T.grid(n, 8):
            with T.sblock("norm"):
                vr, vi = T.axis.remap("SS", [r, i])
                y[vr, vi] = x[vr, vi] * T.rsqrt(sum_sq[vr])

    @T.prim_func(private=True, s_tir=True)
    def scale(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, 8))
        y = T.match_buffer(var_y, (n, 8))
        for r, i in T.grid(n, 8):
            with T.sblock("scale"):
                vr, vi = T.axis.remap("SS", [r, i])
                y[vr, vi] = x[vr, vi] * T.float32(2)

    @T.prim_func(private=True, s_tir=True)
    def gemm(var_x: T.handle, w: T.Buffer((4, 8), "float32"), var_y: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 8))
        y = T.match_buffer(var_y, (m, 4))
        for r, c, k in T.grid(m, 4, 8):
            with T.sblock("gemm"):
                vr, vc, vk = T.axis.remap("SSR", [r, c, k])
                with T.init():
                    y[vr, vc] = T.float32(0)
                y[vr, vc] = y[vr, vc] + w[vc, vk] * x[vr, vk]

    @R.function
    def shared(x: R.Tensor(("seq_len", 8), "float32"), params: R.Tuple(R.Tensor((4, 8), "float32"))):
        seq_len = T.int64()
        cls = _Apart
        with R.dataflow():
            w_proj = params[0]
            h = R.call_tir(cls.norm, (x,), out_ty=R.Tensor((seq_len, 8), "float32"))
            y = R.call_tir(cls.gemm, (h, w_proj), out_ty=R.Tensor((seq_len, 4), "float32"))
            gv = (h, y)
            R.output(gv)
        return gv

    @R.function
    def decode(x: R.Tensor((1, 8), "float32"), params: R.Tuple(R.Tensor((4, 8), "float32"))):
        cls = _Apart
        with R.dataflow():
            w_proj = params[0]
            h = R.call_tir(cls.norm, (x,), out_ty=R.Tensor((1, 8), "float32"))
            y = R.call_tir(cls.gemm, (h, w_proj), out_ty=R.Tensor((1, 4), "float32"))
            R.output(y)
        return y

    @R.function
    def elementwise(x: R.Tensor(("seq_len", 8), "float32"), params: R.Tuple(R.Tensor((4, 8), "float32"))):
        seq_len = T.int64()
        cls = _Apart
        with R.dataflow():
            w_proj = params[0]
            h = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((seq_len, 8), "float32"))
            y = R.call_tir(cls.gemm, (h, w_proj), out_ty=R.Tensor((seq_len, 4), "float32"))
            R.output(y)
        return y


@I.ir_module
class _BeforeRoPE:
    """norm -> projection -> reshape into heads -> an RMSNorm over each head -> a rotate-half over each head that also
    reads the rows' positions (Gemma 3's QKV projection, q/k norm and RoPE), each kernel with its own length
    variable."""

    @T.prim_func(private=True, s_tir=True)
    def norm(var_x: T.handle, w: T.Buffer((8,), "float32"), var_y: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, 8))
        y = T.match_buffer(var_y, (n, 8))
        sum_sq = T.sblock_alloc_buffer((n,))
        for r, k in T.grid(n, 8):
            with T.sblock("sum_sq"):
                vr, vk = T.axis.remap("SR", [r, k])
                with T.init():
                    sum_sq[vr] = T.float32(0)
                sum_sq[vr] = sum_sq[vr] + x[vr, vk] * x[vr, vk]
        for r, i in T.grid(n, 8):
            with T.sblock("norm"):
                vr, vi = T.axis.remap("SS", [r, i])
                y[vr, vi] = x[vr, vi] * T.rsqrt(sum_sq[vr]) * w[vi]

    @T.prim_func(private=True, s_tir=True)
    def gemm(var_x: T.handle, w: T.Buffer((4, 8), "float32"), var_y: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 8))
        y = T.match_buffer(var_y, (m, 4))
        for r, c, k in T.grid(m, 4, 8):
            with T.sblock("gemm"):
                vr, vc, vk = T.axis.remap("SSR", [r, c, k])
                with T.init():
                    y[vr, vc] = T.float32(0)
                y[vr, vc] = y[vr, vc] + w[vc, vk] * x[vr, vk]

    @T.prim_func(private=True, s_tir=True)
    def reshape(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 4))
        y = T.match_buffer(var_y, (m, 2, 2))
        for r, h, d in T.grid(m, 2, 2):
            with T.sblock("reshape"):
                vr, vh, vd = T.axis.remap("SSS", [r, h, d])
                y[vr, vh, vd] = x[vr, vh * 2 + vd]

    @T.prim_func(private=True, s_tir=True)
    def head_norm(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 2, 2))
        y = T.match_buffer(var_y, (m, 2, 2))
        sum_sq = T.sblock_alloc_buffer((m, 2))
        for r, h, d in T.grid(m, 2, 2):
            with T.sblock("head_sum_sq"):
                vr, vh, vd = T.axis.remap("SSR", [r, h, d])
                with T.init():
                    sum_sq[vr, vh] = T.float32(0)
                sum_sq[vr, vh] = sum_sq[vr, vh] + x[vr, vh, vd] * x[vr, vh, vd]
        for r, h, d in T.grid(m, 2, 2):
            with T.sblock("head_norm"):
                vr, vh, vd = T.axis.remap("SSS", [r, h, d])
                y[vr, vh, vd] = x[vr, vh, vd] * T.rsqrt(sum_sq[vr, vh])

    @T.prim_func(private=True, s_tir=True)
    def rope(var_x: T.handle, var_pos: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 1, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 2, 2))
        pos = T.match_buffer(var_pos, (m,), "int32")
        y = T.match_buffer(var_y, (m, 2, 2))
        for r, h, d in T.grid(m, 2, 2):
            with T.sblock("rope"):
                vr, vh, vd = T.axis.remap("SSS", [r, h, d])
                y[vr, vh, vd] = x[vr, vh, vd] * T.Cast("float32", pos[vr]) + T.if_then_else(
                    vd < 1, T.float32(0) - x[vr, vh, vd + 1], x[vr, vh, vd - 1])

    @R.function
    def prefill(x: R.Tensor(("seq_len", 8), "float32"), pos: R.Tensor(("seq_len",), "int32"),
                params: R.Tuple(R.Tensor((8,), "float32"), R.Tensor((4, 8), "float32"))):
        seq_len = T.int64()
        cls = _BeforeRoPE
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            h = R.call_tir(cls.norm, (x, w_norm), out_ty=R.Tensor((seq_len, 8), "float32"))
            y = R.call_tir(cls.gemm, (h, w_proj), out_ty=R.Tensor((seq_len, 4), "float32"))
            heads = R.call_tir(cls.reshape, (y,), out_ty=R.Tensor((seq_len, 2, 2), "float32"))
            normed = R.call_tir(cls.head_norm, (heads,), out_ty=R.Tensor((seq_len, 2, 2), "float32"))
            rotated = R.call_tir(cls.rope, (normed, pos), out_ty=R.Tensor((seq_len, 2, 2), "float32"))
            R.output(rotated)
        return rotated

@I.ir_module
class _ExpectedRoPE:
    """One kernel: the norm, the projection, the reshape, the head norm and the rotate-half, the positions an argument
    of its own (with their own length variable); every other length the norm's."""

    @T.prim_func(private=True, s_tir=True)
    def gemm_after_norm_then_head_norm(var_x: T.handle, w: T.Buffer((8,), "float32"),
                                       w_1: T.Buffer((4, 8), "float32"), var_pos: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        n, m = T.int64(), T.int64()
        x = T.match_buffer(var_x, (n, 8))
        pos = T.match_buffer(var_pos, (m,), "int32")
        y = T.match_buffer(var_y, (n, 2, 2))
        y_1 = T.sblock_alloc_buffer((n, 8))
        y_2 = T.sblock_alloc_buffer((n, 4))
        y_3 = T.sblock_alloc_buffer((n, 2, 2))
        y_4 = T.sblock_alloc_buffer((n, 2, 2))
        sum_sq = T.sblock_alloc_buffer((n,))
        sum_sq_1 = T.sblock_alloc_buffer((n, 2))
        for r, k in T.grid(n, 8):
            with T.sblock("sum_sq"):
                vr, vk = T.axis.remap("SR", [r, k])
                with T.init():
                    sum_sq[vr] = T.float32(0)
                sum_sq[vr] = sum_sq[vr] + x[vr, vk] * x[vr, vk]
        for r, i in T.grid(n, 8):
            with T.sblock("norm"):
                vr, vi = T.axis.remap("SS", [r, i])
                y_1[vr, vi] = x[vr, vi] * T.rsqrt(sum_sq[vr]) * w[vi]
        for r, c, k in T.grid(n, 4, 8):
            with T.sblock("gemm"):
                vr, vc, vk = T.axis.remap("SSR", [r, c, k])
                with T.init():
                    y_2[vr, vc] = T.float32(0)
                y_2[vr, vc] = y_2[vr, vc] + w_1[vc, vk] * y_1[vr, vk]
        for r, h, d in T.grid(n, 2, 2):
            with T.sblock("reshape"):
                vr, vh, vd = T.axis.remap("SSS", [r, h, d])
                y_3[vr, vh, vd] = y_2[vr, vh * 2 + vd]
        for r, h, d in T.grid(n, 2, 2):
            with T.sblock("head_sum_sq"):
                vr, vh, vd = T.axis.remap("SSR", [r, h, d])
                with T.init():
                    sum_sq_1[vr, vh] = T.float32(0)
                sum_sq_1[vr, vh] = sum_sq_1[vr, vh] + y_3[vr, vh, vd] * y_3[vr, vh, vd]
        for r, h, d in T.grid(n, 2, 2):
            with T.sblock("head_norm"):
                vr, vh, vd = T.axis.remap("SSS", [r, h, d])
                y_4[vr, vh, vd] = y_3[vr, vh, vd] * T.rsqrt(sum_sq_1[vr, vh])
        for r, h, d in T.grid(n, 2, 2):
            with T.sblock("rope"):
                vr, vh, vd = T.axis.remap("SSS", [r, h, d])
                y[vr, vh, vd] = y_4[vr, vh, vd] * T.Cast("float32", pos[vr]) + T.if_then_else(
                    vd < 1, T.float32(0) - y_4[vr, vh, vd + 1], y_4[vr, vh, vd - 1])

    @R.function
    def prefill(x: R.Tensor(("seq_len", 8), "float32"), pos: R.Tensor(("seq_len",), "int32"),
                params: R.Tuple(R.Tensor((8,), "float32"), R.Tensor((4, 8), "float32"))):
        seq_len = T.int64()
        cls = _ExpectedRoPE
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            rotated = R.call_tir(cls.gemm_after_norm_then_head_norm, (x, w_norm, w_proj, pos),
                                 out_ty=R.Tensor((seq_len, 2, 2), "float32"))
            R.output(rotated)
        return rotated


def _fused(mod: tvm.IRModule, schedulable=lambda _: True) -> tvm.IRModule:
    return FuseGEMMNorms(schedulable)(mod)


def test_the_norm_a_prefill_gemm_alone_reads_becomes_its_prologue():
    tvm.ir.assert_structural_equal(_fused(_Before), _Expected)


def test_norms_read_elsewhere_decode_shapes_and_elementwise_producers_stay_apart():
    tvm.ir.assert_structural_equal(_fused(_Apart), _Apart)


def test_kernels_the_schedule_does_not_take_stay_apart():
    tvm.ir.assert_structural_equal(_fused(_Before, lambda _: False), _Before)



def test_the_head_norm_and_what_computes_within_its_heads_become_the_epilogue():
    tvm.ir.assert_structural_equal(_fused(_BeforeRoPE), _ExpectedRoPE)


def _kernels_called(func) -> list[str]:
    return [b.value.args[0].name_hint for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.args[0], tvm.ir.GlobalVar)]


def test_an_epilogue_the_schedule_declines_is_shortened_to_the_head_norm():
    """Where the schedule does not take the RoPE after the head norm, it stays a kernel of its own after one that
    ends with the head norm."""
    fused = _fused(_BeforeRoPE, lambda func: "rope" not in [b.name_hint for b in _blocks(func)])
    assert _kernels_called(fused["prefill"]) == ["gemm_after_norm_then_head_norm", "rope"]
    assert [b.name_hint for b in _blocks(fused["gemm_after_norm_then_head_norm"])] == [
        "sum_sq", "norm", "gemm", "reshape", "head_sum_sq", "head_norm"]


def _blocks(func: tvm.tirx.PrimFunc) -> list:
    return [s for s in tir_statements(func.body) if isinstance(s, s_tir.SBlock) and s.name_hint != "root"]

HIDDEN, COLUMNS, EPS = 64, 96, 1e-5


def _norm_gemm() -> tvm.IRModule:
    """A prefill RMSNorm (float32, as the legalized op: sum of squares, rsqrt, the weighted rows) and the GEMM that
    reads its rows, as the pass fuses them."""

    @T.prim_func(s_tir=True)
    def norm_gemm(var_x: T.handle, norm_w: T.Buffer((HIDDEN,), "float32"), w: T.Buffer((COLUMNS, HIDDEN), "float32"),
                  var_out: T.handle):
        T.func_attr({"global_symbol": "norm_gemm", "op_pattern": 4, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, HIDDEN))
        out = T.match_buffer(var_out, (n, COLUMNS))
        sum_sq = T.sblock_alloc_buffer((n,))
        rstd = T.sblock_alloc_buffer((n,))
        normed = T.sblock_alloc_buffer((n, HIDDEN))
        for r, k in T.grid(n, T.int64(HIDDEN)):
            with T.sblock("sum_sq"):
                vr, vk = T.axis.remap("SR", [r, k])
                with T.init():
                    sum_sq[vr] = T.float32(0)
                sum_sq[vr] = sum_sq[vr] + x[vr, vk] * x[vr, vk]
        for r in range(n):
            with T.sblock("rstd"):
                vr = T.axis.spatial(n, r)
                rstd[vr] = T.rsqrt(sum_sq[vr] / T.float32(HIDDEN) + T.float32(EPS))
        for r, k in T.grid(n, T.int64(HIDDEN)):
            with T.sblock("normed"):
                vr, vk = T.axis.remap("SS", [r, k])
                normed[vr, vk] = rstd[vr] * x[vr, vk] * norm_w[vk]
        for r, c, k in T.grid(n, T.int64(COLUMNS), T.int64(HIDDEN)):
            with T.sblock("gemm"):
                vr, vc, vk = T.axis.remap("SSR", [r, c, k])
                with T.init():
                    out[vr, vc] = T.float32(0)
                out[vr, vc] = out[vr, vc] + normed[vr, vk] * w[vc, vk]

    return tvm.IRModule({"norm_gemm": norm_gemm})


def _device_target(target_name: str) -> tvm.target.Target:
    device = {k: v for k, v in load_target(target_name).tvm_target_json.items() if k != "host"}
    return tvm.target.Target(device, host="llvm")


def _scheduled_norm_gemm(target_name: str) -> tvm.IRModule:
    spec = load_target(target_name)
    mod = _norm_gemm()
    with _device_target(target_name) as target:
        rule = gpu_schedules.Matmul(spec.schedule["matmul"])
        assert rule.takes(mod["norm_gemm"], target)
        return dlight.ApplyDefaultSchedule(rule)(mod)


@pytest.mark.parametrize("target_name", ["android-adreno", "android-mali"])
def test_each_thread_reduces_its_rows_before_the_gemm(target_name):
    text = _scheduled_norm_gemm(target_name)["norm_gemm"].script()
    # the sums of squares and their rsqrt in each thread, the normed rows per K step in local memory
    for name in ("sum_sq", "rstd", "normed"):
        assert f'{name}_local = T.sblock_alloc_buffer(' in text
    assert "shared" not in text
    assert text.index('T.sblock("sum_sq")') < text.index('T.sblock("rstd")') < text.index('T.sblock("normed")')


@NEEDS_OPENCL
@pytest.mark.parametrize("target_name", ["android-adreno", "android-mali"])
def test_norm_gemm_numerics_on_opencl(tmp_path, target_name):
    """The scheduled kernel on this machine's OpenCL against numpy, 37 rows: more than one work group's tile of rows
    on either target, the last tile partly past the sequence. A norm left out is off by far more than the
    tolerance."""
    opencl_device.load()
    dev = tvm.opencl(0)
    # our OpenCL runtime serves kernels of a library loaded from a file (as an artifact's)
    tvm.compile(_scheduled_norm_gemm(target_name), target=_device_target(target_name)).export_library(
        str(tmp_path / "norm_gemm.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "norm_gemm.so"))
    rng = np.random.default_rng(0)
    rows = 37
    x = rng.standard_normal((rows, HIDDEN)).astype("float32")
    norm_w = rng.uniform(0.5, 1.5, HIDDEN).astype("float32")
    w = rng.standard_normal((COLUMNS, HIDDEN)).astype("float32")
    normed = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + EPS) * norm_w
    out = tvm.runtime.tensor(np.full((rows, COLUMNS), np.nan, "float32"), dev)
    lib["norm_gemm"](*(tvm.runtime.tensor(a, dev) for a in (x, norm_w, w)), out)
    got = out.numpy()
    np.testing.assert_allclose(got, normed @ w.T, rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, (x * norm_w) @ w.T, rtol=1e-2, atol=1e-2)  # negative control: no norm


@I.ir_module
class _Residual:
    """A post-norm kernel with its residual add (Gemma 3's), the RMSNorm of its result, the prefill GEMM that reads
    that, and a kernel that reads the residual stream too (the next residual add): after the GEMM (prefill), or
    before it (early: the negative control, whose residual stream is read before the fused kernel would write it)."""

    @T.prim_func(private=True, s_tir=True)
    def post_norm_add(var_o: T.handle, var_res: T.handle, w: T.Buffer((HIDDEN,), "float32"), var_h: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        n = T.int64()
        o = T.match_buffer(var_o, (n, HIDDEN))
        res = T.match_buffer(var_res, (n, HIDDEN))
        h = T.match_buffer(var_h, (n, HIDDEN))
        sum_sq = T.sblock_alloc_buffer((n,))
        for r, k in T.grid(n, T.int64(HIDDEN)):
            with T.sblock("post_sum_sq"):
                vr, vk = T.axis.remap("SR", [r, k])
                with T.init():
                    sum_sq[vr] = T.float32(0)
                sum_sq[vr] = sum_sq[vr] + o[vr, vk] * o[vr, vk]
        for r, k in T.grid(n, T.int64(HIDDEN)):
            with T.sblock("post_norm_add"):
                vr, vk = T.axis.remap("SS", [r, k])
                h[vr, vk] = res[vr, vk] + o[vr, vk] * T.rsqrt(sum_sq[vr] / T.float32(HIDDEN) + T.float32(EPS)) * w[vk]

    @T.prim_func(private=True, s_tir=True)
    def norm(var_x: T.handle, w: T.Buffer((HIDDEN,), "float32"), var_y: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, HIDDEN))
        y = T.match_buffer(var_y, (n, HIDDEN))
        sum_sq = T.sblock_alloc_buffer((n,))
        for r, k in T.grid(n, T.int64(HIDDEN)):
            with T.sblock("sum_sq"):
                vr, vk = T.axis.remap("SR", [r, k])
                with T.init():
                    sum_sq[vr] = T.float32(0)
                sum_sq[vr] = sum_sq[vr] + x[vr, vk] * x[vr, vk]
        for r, k in T.grid(n, T.int64(HIDDEN)):
            with T.sblock("norm"):
                vr, vk = T.axis.remap("SS", [r, k])
                y[vr, vk] = x[vr, vk] * T.rsqrt(sum_sq[vr] / T.float32(HIDDEN) + T.float32(EPS)) * w[vk]

    @T.prim_func(private=True, s_tir=True)
    def gemm(var_x: T.handle, w: T.Buffer((COLUMNS, HIDDEN), "float32"), var_y: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, HIDDEN))
        y = T.match_buffer(var_y, (m, COLUMNS))
        for r, c, k in T.grid(m, T.int64(COLUMNS), T.int64(HIDDEN)):
            with T.sblock("gemm"):
                vr, vc, vk = T.axis.remap("SSR", [r, c, k])
                with T.init():
                    y[vr, vc] = T.float32(0)
                y[vr, vc] = y[vr, vc] + w[vc, vk] * x[vr, vk]

    @T.prim_func(private=True, s_tir=True)
    def double(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, HIDDEN))
        y = T.match_buffer(var_y, (m, HIDDEN))
        for r, k in T.grid(m, T.int64(HIDDEN)):
            with T.sblock("double"):
                vr, vk = T.axis.remap("SS", [r, k])
                y[vr, vk] = x[vr, vk] * T.float32(2)

    @R.function
    def prefill(o: R.Tensor(("seq_len", HIDDEN), "float32"), res: R.Tensor(("seq_len", HIDDEN), "float32"),
                params: R.Tuple(R.Tensor((HIDDEN,), "float32"), R.Tensor((HIDDEN,), "float32"),
                                R.Tensor((COLUMNS, HIDDEN), "float32"))):
        seq_len = T.int64()
        cls = _Residual
        with R.dataflow():
            w_post = params[0]
            w_norm = params[1]
            w_proj = params[2]
            h = R.call_tir(cls.post_norm_add, (o, res, w_post), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            x = R.call_tir(cls.norm, (h, w_norm), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            y = R.call_tir(cls.gemm, (x, w_proj), out_ty=R.Tensor((seq_len, COLUMNS), "float32"))
            z = R.call_tir(cls.double, (h,), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            gv = (y, z)
            R.output(gv)
        return gv

    @R.function
    def early(o: R.Tensor(("seq_len", HIDDEN), "float32"), res: R.Tensor(("seq_len", HIDDEN), "float32"),
              params: R.Tuple(R.Tensor((HIDDEN,), "float32"), R.Tensor((HIDDEN,), "float32"),
                              R.Tensor((COLUMNS, HIDDEN), "float32"))):
        seq_len = T.int64()
        cls = _Residual
        with R.dataflow():
            w_post = params[0]
            w_norm = params[1]
            w_proj = params[2]
            h = R.call_tir(cls.post_norm_add, (o, res, w_post), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            z = R.call_tir(cls.double, (h,), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            x = R.call_tir(cls.norm, (h, w_norm), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            y = R.call_tir(cls.gemm, (x, w_proj), out_ty=R.Tensor((seq_len, COLUMNS), "float32"))
            gv = (y, z)
            R.output(gv)
        return gv


def _blocks_named(func: tvm.tirx.PrimFunc) -> list[str]:
    return [b.name_hint for b in _blocks(func)]


def test_a_residual_prologue_read_after_the_gemm_runs_again_into_a_second_result():
    """The post-norm kernel, the norm and the GEMM as one kernel, which runs the post-norm kernel a second time, last,
    into its first result (the residual stream the later kernel reads); read before the GEMM, the post-norm kernel
    stays apart (negative control) and the norm alone runs inside the GEMM."""
    fused = _fused(_Residual)
    assert _kernels_called(fused["prefill"]) == ["gemm_after_norm_after_post_norm_add", "double"]
    kernel = fused["gemm_after_norm_after_post_norm_add"]
    assert _blocks_named(kernel) == ["post_sum_sq", "post_norm_add", "sum_sq", "norm", "gemm", "post_sum_sq",
                                     "post_norm_add"]
    assert [[int(d) for d in p.shape[1:]] for p in kernel.params[-2:]] == [[HIDDEN], [COLUMNS]]
    # the later kernel reads the kernel's first result
    values = {b.var: b.value for block in fused["prefill"].body.blocks for b in block.bindings}
    double = next(v for v in values.values() if isinstance(v, relax.Call) and v.args[0].name_hint == "double")
    stream = values[double.args[1].fields[0]]
    assert isinstance(stream, relax.TupleGetItem) and stream.index == 0
    assert values[stream.tuple_value].args[0].name_hint == "gemm_after_norm_after_post_norm_add"
    assert _kernels_called(fused["early"]) == ["post_norm_add", "double", "gemm_after_norm"]

# heads of 32: whole heads in either target's tile (256 columns on android-adreno, 64 on android-mali); of 128: wider
# than android-mali's tile (Qwen3's real heads), which the rule widens to whole heads
HEAD_DIMS = [32, 128]
GEMM_COLUMNS = 512
ROTATED_HEADS = GEMM_COLUMNS // 128 - 1  # q and k heads; v is not rotated


def _norm_gemm_head_norm(head_dim: int, rope: bool) -> tvm.IRModule:
    """_norm_gemm's kernel with, after the GEMM, its columns as heads of `head_dim` (the reshape's generic flat
    index) and an RMSNorm over each head's columns: Qwen3's QKV projection with its q/k norm as the pass fuses them;
    with `rope`, then Gemma 3's RoPE of the first heads (rotate-half: each value reads the one half a head away; the
    positions and frequencies are arguments, unread without it)."""
    heads_count, half = GEMM_COLUMNS // head_dim, head_dim // 2

    @T.prim_func(s_tir=True)
    def norm_gemm_head_norm(var_x: T.handle, norm_w: T.Buffer((HIDDEN,), "float32"),
                            w: T.Buffer((GEMM_COLUMNS, HIDDEN), "float32"), head_w: T.Buffer((head_dim,), "float32"),
                            var_pos: T.handle, freq: T.Buffer((half,), "float32"), var_out: T.handle):
        T.func_attr({"global_symbol": "norm_gemm_head_norm", "op_pattern": 4, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, HIDDEN))
        pos = T.match_buffer(var_pos, (n,), "int32")
        out = T.match_buffer(var_out, (n, heads_count, head_dim))
        sum_sq = T.sblock_alloc_buffer((n,))
        rstd = T.sblock_alloc_buffer((n,))
        normed = T.sblock_alloc_buffer((n, HIDDEN))
        y = T.sblock_alloc_buffer((n, GEMM_COLUMNS))
        heads = T.sblock_alloc_buffer((n, heads_count, head_dim))
        head_sum_sq = T.sblock_alloc_buffer((n, heads_count))
        normed_heads = T.sblock_alloc_buffer((n, heads_count, head_dim))
        for r, k in T.grid(n, T.int64(HIDDEN)):
            with T.sblock("sum_sq"):
                vr, vk = T.axis.remap("SR", [r, k])
                with T.init():
                    sum_sq[vr] = T.float32(0)
                sum_sq[vr] = sum_sq[vr] + x[vr, vk] * x[vr, vk]
        for r in range(n):
            with T.sblock("rstd"):
                vr = T.axis.spatial(n, r)
                rstd[vr] = T.rsqrt(sum_sq[vr] / T.float32(HIDDEN) + T.float32(EPS))
        for r, k in T.grid(n, T.int64(HIDDEN)):
            with T.sblock("normed"):
                vr, vk = T.axis.remap("SS", [r, k])
                normed[vr, vk] = rstd[vr] * x[vr, vk] * norm_w[vk]
        for r, c, k in T.grid(n, T.int64(GEMM_COLUMNS), T.int64(HIDDEN)):
            with T.sblock("gemm"):
                vr, vc, vk = T.axis.remap("SSR", [r, c, k])
                with T.init():
                    y[vr, vc] = T.float32(0)
                y[vr, vc] = y[vr, vc] + normed[vr, vk] * w[vc, vk]
        for r, h, d in T.grid(n, T.int64(heads_count), T.int64(head_dim)):
            with T.sblock("reshape"):
                vr, vh, vd = T.axis.remap("SSS", [r, h, d])
                heads[vr, vh, vd] = y[((vh * T.int64(head_dim) + vd) // T.int64(GEMM_COLUMNS) + vr) % n,
                                      (vh * T.int64(head_dim) + vd) % T.int64(GEMM_COLUMNS)]
        for r, h, d in T.grid(n, T.int64(heads_count), T.int64(head_dim)):
            with T.sblock("head_sum_sq"):
                vr, vh, vd = T.axis.remap("SSR", [r, h, d])
                with T.init():
                    head_sum_sq[vr, vh] = T.float32(0)
                head_sum_sq[vr, vh] = head_sum_sq[vr, vh] + heads[vr, vh, vd] * heads[vr, vh, vd]
        if rope:
            for r, h, d in T.grid(n, T.int64(heads_count), T.int64(head_dim)):
                with T.sblock("head_norm"):
                    vr, vh, vd = T.axis.remap("SSS", [r, h, d])
                    normed_heads[vr, vh, vd] = heads[vr, vh, vd] * head_w[vd] * T.rsqrt(
                        head_sum_sq[vr, vh] / T.float32(head_dim) + T.float32(EPS))
            for r, h, d in T.grid(n, T.int64(heads_count), T.int64(head_dim)):
                with T.sblock("rope"):
                    vr, vh, vd = T.axis.remap("SSS", [r, h, d])
                    out[vr, vh, vd] = T.if_then_else(
                        vh < T.int64(ROTATED_HEADS),
                        normed_heads[vr, vh, vd] * T.cos(T.Cast("float32", pos[vr]) * freq[vd % T.int64(half)])
                        + T.if_then_else(vd < T.int64(half), T.float32(0) - normed_heads[vr, vh, vd + T.int64(half)],
                                         normed_heads[vr, vh, vd - T.int64(half)])
                        * T.sin(T.Cast("float32", pos[vr]) * freq[vd % T.int64(half)]),
                        normed_heads[vr, vh, vd])
        else:
            for r, h, d in T.grid(n, T.int64(heads_count), T.int64(head_dim)):
                with T.sblock("head_norm"):
                    vr, vh, vd = T.axis.remap("SSS", [r, h, d])
                    out[vr, vh, vd] = heads[vr, vh, vd] * head_w[vd] * T.rsqrt(
                        head_sum_sq[vr, vh] / T.float32(head_dim) + T.float32(EPS))

    return tvm.IRModule({"norm_gemm_head_norm": norm_gemm_head_norm})


def _rope(x: np.ndarray, pos: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """numpy's rotate-half RoPE of the first ROTATED_HEADS heads of x [rows, heads, head_dim]."""
    angle = pos[:, None, None].astype("float32") * np.concatenate([freq, freq])[None, None, :]
    half = x.shape[-1] // 2
    partner = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    rotated = x * np.cos(angle) + partner * np.sin(angle)
    return np.concatenate([rotated[:, :ROTATED_HEADS], x[:, ROTATED_HEADS:]], axis=1)


# the default set: each target's heads of 32 as Qwen3 fuses them, RoPE on android-adreno, and android-mali's widened
# tile with RoPE (a second on Adreno, five on Mali under PoCL); the rest extended
_HEAD_NORM_CASES = [pytest.param(target, head_dim, rope, marks=() if (target, head_dim, rope) in {
    ("android-adreno", 32, False), ("android-mali", 32, False), ("android-adreno", 32, True),
    ("android-mali", 128, True)} else pytest.mark.extended)
    for target in ("android-adreno", "android-mali") for head_dim in HEAD_DIMS for rope in (False, True)]


@NEEDS_OPENCL
@pytest.mark.parametrize("target_name,head_dim,rope", _HEAD_NORM_CASES)
def test_norm_gemm_head_norm_numerics_on_opencl(tmp_path, target_name, head_dim, rope):
    """The scheduled kernel with the head norm (and RoPE) on this machine's OpenCL against numpy, 29 rows: the last
    tile of rows partly past the sequence on either target."""
    opencl_device.load()
    dev = tvm.opencl(0)
    mod = _norm_gemm_head_norm(head_dim, rope)
    with _device_target(target_name) as target:
        rule = gpu_schedules.Matmul(load_target(target_name).schedule["matmul"])
        assert rule.takes(mod["norm_gemm_head_norm"], target)
        scheduled = dlight.ApplyDefaultSchedule(rule)(mod)
    tvm.compile(scheduled, target=_device_target(target_name)).export_library(str(tmp_path / "kernel.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "kernel.so"))
    rng = np.random.default_rng(0)
    rows, heads_count = 29, GEMM_COLUMNS // head_dim
    x = rng.standard_normal((rows, HIDDEN)).astype("float32")
    norm_w = rng.uniform(0.5, 1.5, HIDDEN).astype("float32")
    w = rng.standard_normal((GEMM_COLUMNS, HIDDEN)).astype("float32")
    head_w = rng.uniform(0.5, 1.5, head_dim).astype("float32")
    pos = np.arange(3, 3 + rows, dtype="int32")
    freq = (1 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)).astype("float32")
    y = (x / np.sqrt((x * x).mean(axis=1, keepdims=True) + EPS) * norm_w) @ w.T
    heads = y.reshape(rows, heads_count, head_dim)
    normed = heads / np.sqrt((heads * heads).mean(axis=2, keepdims=True) + EPS) * head_w
    expected = _rope(normed, pos, freq) if rope else normed
    out = tvm.runtime.tensor(np.full((rows, heads_count, head_dim), np.nan, "float32"), dev)
    lib["norm_gemm_head_norm"](*(tvm.runtime.tensor(a, dev) for a in (x, norm_w, w, head_w, pos, freq)), out)
    got = out.numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, heads * head_w, rtol=1e-2, atol=1e-2)  # negative control: no head norm
    if rope:  # negative control: the rotated heads not rotated
        assert not np.allclose(got[:, :ROTATED_HEADS], normed[:, :ROTATED_HEADS], rtol=1e-2, atol=1e-2)


def _scheduled_residual_norm_gemm(target_name: str) -> tvm.IRModule:
    kernel = _fused(_Residual)["gemm_after_norm_after_post_norm_add"].with_attr("global_symbol", "kernel")
    mod = tvm.IRModule({"kernel": kernel})
    with _device_target(target_name) as target:
        rule = gpu_schedules.Matmul(load_target(target_name).schedule["matmul"])
        assert rule.takes(kernel, target)
        return dlight.ApplyDefaultSchedule(rule)(mod)


@NEEDS_OPENCL
# the second run is the same on both targets (the first work group, every row); android-mali's tiles extended
@pytest.mark.parametrize("target_name", ["android-adreno", pytest.param("android-mali", marks=pytest.mark.extended)])
def test_residual_norm_gemm_numerics_on_opencl(tmp_path, target_name):
    """The kernel with the residual prologue on this machine's OpenCL against numpy, 37 rows (more than one tile of
    rows, the last partly past the sequence): the GEMM of the normed residual stream, and the residual stream itself
    as the second result, every value written (the results start as NaN)."""
    opencl_device.load()
    dev = tvm.opencl(0)
    tvm.compile(_scheduled_residual_norm_gemm(target_name), target=_device_target(target_name)).export_library(
        str(tmp_path / "kernel.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "kernel.so"))
    rng = np.random.default_rng(0)
    rows = 37
    o, res = (rng.standard_normal((rows, HIDDEN)).astype("float32") for _ in range(2))
    w_post, w_norm = (rng.uniform(0.5, 1.5, HIDDEN).astype("float32") for _ in range(2))
    w = rng.standard_normal((COLUMNS, HIDDEN)).astype("float32")

    def rms_norm(x, weight):
        return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + EPS) * weight

    h = res + rms_norm(o, w_post)
    stream = tvm.runtime.tensor(np.full((rows, HIDDEN), np.nan, "float32"), dev)
    out = tvm.runtime.tensor(np.full((rows, COLUMNS), np.nan, "float32"), dev)
    lib["kernel"](*(tvm.runtime.tensor(a, dev) for a in (o, res, w_post, w_norm, w)), stream, out)
    np.testing.assert_allclose(stream.numpy(), h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.numpy(), rms_norm(h, w_norm) @ w.T, rtol=1e-4, atol=1e-4)
    # negative control: without the post-norm the GEMM differs by far more than the tolerance
    assert not np.allclose(out.numpy(), rms_norm(res + o, w_norm) @ w.T, rtol=1e-2, atol=1e-2)
