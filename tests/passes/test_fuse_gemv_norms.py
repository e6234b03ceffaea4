"""FuseGEMVNorms: IR in/IR out (Before/Expected) for the norm before a GEMV (prologue), the norm kernel that norm
reads (a post-norm with its residual add, run again into a second result), and the norm over each head after it
(epilogue), the kernels it must leave alone (negative controls), the GPU GEMV rule on these fused kernels (each work
group reduces the row across its K threads; the second run's result from the first work group; one head per work
group), and their numerics on this machine's OpenCL against numpy."""

import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.s_tir import dlight
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.passes.fuse_gemv_norms import FuseGEMVNorms
from compiler.runtime import opencl_device
from compiler.schedules import gpu as gpu_schedules
from compiler.target.targets import load_target
from tests.helpers.pocl_device import NEEDS_OPENCL


@I.ir_module
class _Before:
    """norm (a row reduction, read only by the projection) -> projection (reads a 2-D weight)."""

    @T.prim_func(private=True, s_tir=True)
    def norm(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8,), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        sum_sq = T.sblock_alloc_buffer((1,))
        for k in range(8):
            with T.sblock("sum_sq"):
                vk = T.axis.reduce(8, k)
                with T.init():
                    sum_sq[0] = T.float32(0)
                sum_sq[0] = sum_sq[0] + x[0, vk] * x[0, vk]
        for i in range(8):
            with T.sblock("norm"):
                vi = T.axis.spatial(8, i)
                y[0, vi] = x[0, vi] * T.rsqrt(sum_sq[0]) * w[vi]

    @T.prim_func(private=True, s_tir=True)
    def gemv(x: T.Buffer((1, 8), "float32"), w: T.Buffer((4, 8), "float32"), y: T.Buffer((1, 4), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        for n, k in T.grid(4, 8):
            with T.sblock("gemv"):
                vn, vk = T.axis.remap("SR", [n, k])
                with T.init():
                    y[0, vn] = T.float32(0)
                y[0, vn] = y[0, vn] + w[vn, vk] * x[0, vk]

    @R.function
    def decode(x: R.Tensor((1, 8), "float32"), params: R.Tuple(R.Tensor((8,), "float32"),
                                                              R.Tensor((4, 8), "float32"))):
        cls = _Before
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            h = R.call_tir(cls.norm, (x, w_norm), out_ty=R.Tensor((1, 8), "float32"))
            y = R.call_tir(cls.gemv, (h, w_proj), out_ty=R.Tensor((1, 4), "float32"))
            R.output(y)
        return y


@I.ir_module
class _Expected:
    """One kernel: the norm's blocks, its result a buffer of the kernel's own, then the projection's."""

    @T.prim_func(private=True, s_tir=True)
    def gemv_after_norm(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8,), "float32"),
                        w_1: T.Buffer((4, 8), "float32"), y_1: T.Buffer((1, 4), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        with T.sblock("root"):
            T.reads()
            T.writes()
            sum_sq = T.sblock_alloc_buffer((1,))
            y = T.sblock_alloc_buffer((1, 8))
            for k in range(8):
                with T.sblock("sum_sq"):
                    vk = T.axis.reduce(8, k)
                    with T.init():
                        sum_sq[0] = T.float32(0)
                    sum_sq[0] = sum_sq[0] + x[0, vk] * x[0, vk]
            for i in range(8):
                with T.sblock("norm"):
                    vi = T.axis.spatial(8, i)
                    y[0, vi] = x[0, vi] * T.rsqrt(sum_sq[0]) * w[vi]
            for n, k in T.grid(4, 8):
                with T.sblock("gemv"):
                    vn, vk = T.axis.remap("SR", [n, k])
                    with T.init():
                        y_1[0, vn] = T.float32(0)
                    y_1[0, vn] = y_1[0, vn] + w_1[vn, vk] * y[0, vk]

    @R.function
    def decode(x: R.Tensor((1, 8), "float32"), params: R.Tuple(R.Tensor((8,), "float32"),
                                                              R.Tensor((4, 8), "float32"))):
        cls = _Expected
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            y = R.call_tir(cls.gemv_after_norm, (x, w_norm, w_proj), out_ty=R.Tensor((1, 4), "float32"))
            R.output(y)
        return y


@I.ir_module
class _Apart:
    """Negative controls. shared: the norm's result is also an output; weights: the producer is itself a GEMV (two
    projections are not one kernel); elementwise: a producer that reduces nothing (SwiGLU's kind), which every work
    group would recompute for every weight."""

    @T.prim_func(private=True, s_tir=True)
    def norm(x: T.Buffer((1, 8), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        sum_sq = T.sblock_alloc_buffer((1,))
        for k in range(8):
            with T.sblock("sum_sq"):
                vk = T.axis.reduce(8, k)
                with T.init():
                    sum_sq[0] = T.float32(0)
                sum_sq[0] = sum_sq[0] + x[0, vk] * x[0, vk]
        for i in range(8):
            with T.sblock("norm"):
                vi = T.axis.spatial(8, i)
                y[0, vi] = x[0, vi] * T.rsqrt(sum_sq[0])

    @T.prim_func(private=True, s_tir=True)
    def gemv(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8, 8), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        for n, k in T.grid(8, 8):
            with T.sblock("gemv"):
                vn, vk = T.axis.remap("SR", [n, k])
                with T.init():
                    y[0, vn] = T.float32(0)
                y[0, vn] = y[0, vn] + w[vn, vk] * x[0, vk]

    @T.prim_func(private=True, s_tir=True)
    def scale(x: T.Buffer((1, 8), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        for i in range(8):
            with T.sblock("scale"):
                vi = T.axis.spatial(8, i)
                y[0, vi] = x[0, vi] * T.sigmoid(x[0, vi])

    @R.function
    def shared(x: R.Tensor((1, 8), "float32"), params: R.Tuple(R.Tensor((8, 8), "float32"))):
        cls = _Apart
        with R.dataflow():
            w = params[0]
            h = R.call_tir(cls.norm, (x,), out_ty=R.Tensor((1, 8), "float32"))
            y = R.call_tir(cls.gemv, (h, w), out_ty=R.Tensor((1, 8), "float32"))
            R.output(h, y)
        return (h, y)

    @R.function
    def weights(x: R.Tensor((1, 8), "float32"), params: R.Tuple(R.Tensor((8, 8), "float32"))):
        cls = _Apart
        with R.dataflow():
            w = params[0]
            h = R.call_tir(cls.gemv, (x, w), out_ty=R.Tensor((1, 8), "float32"))
            y = R.call_tir(cls.gemv, (h, w), out_ty=R.Tensor((1, 8), "float32"))
            R.output(y)
        return y

    @R.function
    def elementwise(x: R.Tensor((1, 8), "float32"), params: R.Tuple(R.Tensor((8, 8), "float32"))):
        cls = _Apart
        with R.dataflow():
            w = params[0]
            h = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((1, 8), "float32"))
            y = R.call_tir(cls.gemv, (h, w), out_ty=R.Tensor((1, 8), "float32"))
            R.output(y)
        return y


@I.ir_module
class _Heads:
    """projection (reads a 2-D weight) -> reshape to (heads, head_dim) -> a norm over each head (Qwen3's q/k norm)."""

    @T.prim_func(private=True, s_tir=True)
    def gemv(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8, 8), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        for n, k in T.grid(8, 8):
            with T.sblock("gemv"):
                vn, vk = T.axis.remap("SR", [n, k])
                with T.init():
                    y[0, vn] = T.float32(0)
                y[0, vn] = y[0, vn] + w[vn, vk] * x[0, vk]

    @T.prim_func(private=True, s_tir=True)
    def reshape(y: T.Buffer((1, 8), "float32"), heads: T.Buffer((2, 4), "float32")):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        for h, d in T.grid(2, 4):
            with T.sblock("reshape"):
                vh, vd = T.axis.remap("SS", [h, d])
                heads[vh, vd] = y[0, vh * 4 + vd]

    @T.prim_func(private=True, s_tir=True)
    def head_norm(x: T.Buffer((2, 4), "float32"), w: T.Buffer((4,), "float32"), y: T.Buffer((2, 4), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        sum_sq = T.sblock_alloc_buffer((2,))
        for h, d in T.grid(2, 4):
            with T.sblock("sum_sq"):
                vh, vd = T.axis.remap("SR", [h, d])
                with T.init():
                    sum_sq[vh] = T.float32(0)
                sum_sq[vh] = sum_sq[vh] + x[vh, vd] * x[vh, vd]
        for h, d in T.grid(2, 4):
            with T.sblock("norm"):
                vh, vd = T.axis.remap("SS", [h, d])
                y[vh, vd] = x[vh, vd] * T.rsqrt(sum_sq[vh]) * w[vd]

    @R.function
    def decode(x: R.Tensor((1, 8), "float32"),
               params: R.Tuple(R.Tensor((8, 8), "float32"), R.Tensor((4,), "float32"))):
        cls = _Heads
        with R.dataflow():
            w_proj = params[0]
            w_norm = params[1]
            y = R.call_tir(cls.gemv, (x, w_proj), out_ty=R.Tensor((1, 8), "float32"))
            heads = R.call_tir(cls.reshape, (y,), out_ty=R.Tensor((2, 4), "float32"))
            z = R.call_tir(cls.head_norm, (heads, w_norm), out_ty=R.Tensor((2, 4), "float32"))
            R.output(z)
        return z


@I.ir_module
class _HeadsExpected:
    """One kernel: the projection's blocks, the reshape's, the norm's; the first two results buffers of its own."""

    @T.prim_func(private=True, s_tir=True)
    def gemv_then_head_norm(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8, 8), "float32"),
                            w_1: T.Buffer((4,), "float32"), y: T.Buffer((2, 4), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        with T.sblock("root"):
            T.reads()
            T.writes()
            y_1 = T.sblock_alloc_buffer((1, 8))
            heads = T.sblock_alloc_buffer((2, 4))
            sum_sq = T.sblock_alloc_buffer((2,))
            for n, k in T.grid(8, 8):
                with T.sblock("gemv"):
                    vn, vk = T.axis.remap("SR", [n, k])
                    with T.init():
                        y_1[0, vn] = T.float32(0)
                    y_1[0, vn] = y_1[0, vn] + w[vn, vk] * x[0, vk]
            for h, d in T.grid(2, 4):
                with T.sblock("reshape"):
                    vh, vd = T.axis.remap("SS", [h, d])
                    heads[vh, vd] = y_1[0, vh * 4 + vd]
            for h, d in T.grid(2, 4):
                with T.sblock("sum_sq"):
                    vh, vd = T.axis.remap("SR", [h, d])
                    with T.init():
                        sum_sq[vh] = T.float32(0)
                    sum_sq[vh] = sum_sq[vh] + heads[vh, vd] * heads[vh, vd]
            for h, d in T.grid(2, 4):
                with T.sblock("norm"):
                    vh, vd = T.axis.remap("SS", [h, d])
                    y[vh, vd] = heads[vh, vd] * T.rsqrt(sum_sq[vh]) * w_1[vd]

    @R.function
    def decode(x: R.Tensor((1, 8), "float32"),
               params: R.Tuple(R.Tensor((8, 8), "float32"), R.Tensor((4,), "float32"))):
        cls = _HeadsExpected
        with R.dataflow():
            w_proj = params[0]
            w_norm = params[1]
            z = R.call_tir(cls.gemv_then_head_norm, (x, w_proj, w_norm), out_ty=R.Tensor((2, 4), "float32"))
            R.output(z)
        return z


@I.ir_module
class _HeadsApart:
    """Negative controls. read_twice: the projection's result is also an output; no_norm: what follows the reshape
    reduces nothing (an elementwise scale), so there is no norm to take."""

    @T.prim_func(private=True, s_tir=True)
    def gemv(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8, 8), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        for n, k in T.grid(8, 8):
            with T.sblock("gemv"):
                vn, vk = T.axis.remap("SR", [n, k])
                with T.init():
                    y[0, vn] = T.float32(0)
                y[0, vn] = y[0, vn] + w[vn, vk] * x[0, vk]

    @T.prim_func(private=True, s_tir=True)
    def reshape(y: T.Buffer((1, 8), "float32"), heads: T.Buffer((2, 4), "float32")):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        for h, d in T.grid(2, 4):
            with T.sblock("reshape"):
                vh, vd = T.axis.remap("SS", [h, d])
                heads[vh, vd] = y[0, vh * 4 + vd]

    @T.prim_func(private=True, s_tir=True)
    def scale(x: T.Buffer((2, 4), "float32"), y: T.Buffer((2, 4), "float32")):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        for h, d in T.grid(2, 4):
            with T.sblock("scale"):
                vh, vd = T.axis.remap("SS", [h, d])
                y[vh, vd] = x[vh, vd] * T.float32(2)

    @R.function
    def read_twice(x: R.Tensor((1, 8), "float32"), params: R.Tuple(R.Tensor((8, 8), "float32"))):
        cls = _HeadsApart
        with R.dataflow():
            w = params[0]
            y = R.call_tir(cls.gemv, (x, w), out_ty=R.Tensor((1, 8), "float32"))
            heads = R.call_tir(cls.reshape, (y,), out_ty=R.Tensor((2, 4), "float32"))
            R.output(y, heads)
        return (y, heads)

    @R.function
    def no_norm(x: R.Tensor((1, 8), "float32"), params: R.Tuple(R.Tensor((8, 8), "float32"))):
        cls = _HeadsApart
        with R.dataflow():
            w = params[0]
            y = R.call_tir(cls.gemv, (x, w), out_ty=R.Tensor((1, 8), "float32"))
            heads = R.call_tir(cls.reshape, (y,), out_ty=R.Tensor((2, 4), "float32"))
            z = R.call_tir(cls.scale, (heads,), out_ty=R.Tensor((2, 4), "float32"))
            R.output(z)
        return z


@I.ir_module
class _CastBefore:
    """cast (float16 -> float32, read only by the norm) -> norm -> projection: Gemma's float32 norm of a float16 row."""

    @T.prim_func(private=True, s_tir=True)
    def cast(x: T.Buffer((1, 8), "float16"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        for i in range(8):
            with T.sblock("cast"):
                vi = T.axis.spatial(8, i)
                y[0, vi] = T.Cast("float32", x[0, vi])

    @T.prim_func(private=True, s_tir=True)
    def norm(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8,), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        sum_sq = T.sblock_alloc_buffer((1,))
        for k in range(8):
            with T.sblock("sum_sq"):
                vk = T.axis.reduce(8, k)
                with T.init():
                    sum_sq[0] = T.float32(0)
                sum_sq[0] = sum_sq[0] + x[0, vk] * x[0, vk]
        for i in range(8):
            with T.sblock("norm"):
                vi = T.axis.spatial(8, i)
                y[0, vi] = x[0, vi] * T.rsqrt(sum_sq[0]) * w[vi]

    @T.prim_func(private=True, s_tir=True)
    def gemv(x: T.Buffer((1, 8), "float32"), w: T.Buffer((4, 8), "float32"), y: T.Buffer((1, 4), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        for n, k in T.grid(4, 8):
            with T.sblock("gemv"):
                vn, vk = T.axis.remap("SR", [n, k])
                with T.init():
                    y[0, vn] = T.float32(0)
                y[0, vn] = y[0, vn] + w[vn, vk] * x[0, vk]

    @R.function
    def decode(x: R.Tensor((1, 8), "float16"), params: R.Tuple(R.Tensor((8,), "float32"),
                                                              R.Tensor((4, 8), "float32"))):
        cls = _CastBefore
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            x32 = R.call_tir(cls.cast, (x,), out_ty=R.Tensor((1, 8), "float32"))
            h = R.call_tir(cls.norm, (x32, w_norm), out_ty=R.Tensor((1, 8), "float32"))
            y = R.call_tir(cls.gemv, (h, w_proj), out_ty=R.Tensor((1, 4), "float32"))
            R.output(y)
        return y


@I.ir_module
class _CastExpected:
    """One kernel: the cast's block, the norm's, the projection's; the cast and norm results buffers of its own."""

    @T.prim_func(private=True, s_tir=True)
    def gemv_after_norm(x: T.Buffer((1, 8), "float16"), w: T.Buffer((8,), "float32"),
                        w_1: T.Buffer((4, 8), "float32"), y: T.Buffer((1, 4), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        with T.sblock("root"):
            T.reads()
            T.writes()
            y_1 = T.sblock_alloc_buffer((1, 8))
            sum_sq = T.sblock_alloc_buffer((1,))
            y_2 = T.sblock_alloc_buffer((1, 8))
            for i in range(8):
                with T.sblock("cast"):
                    vi = T.axis.spatial(8, i)
                    y_1[0, vi] = T.Cast("float32", x[0, vi])
            for k in range(8):
                with T.sblock("sum_sq"):
                    vk = T.axis.reduce(8, k)
                    with T.init():
                        sum_sq[0] = T.float32(0)
                    sum_sq[0] = sum_sq[0] + y_1[0, vk] * y_1[0, vk]
            for i in range(8):
                with T.sblock("norm"):
                    vi = T.axis.spatial(8, i)
                    y_2[0, vi] = y_1[0, vi] * T.rsqrt(sum_sq[0]) * w[vi]
            for n, k in T.grid(4, 8):
                with T.sblock("gemv"):
                    vn, vk = T.axis.remap("SR", [n, k])
                    with T.init():
                        y[0, vn] = T.float32(0)
                    y[0, vn] = y[0, vn] + w_1[vn, vk] * y_2[0, vk]

    @R.function
    def decode(x: R.Tensor((1, 8), "float16"), params: R.Tuple(R.Tensor((8,), "float32"),
                                                              R.Tensor((4, 8), "float32"))):
        cls = _CastExpected
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            y = R.call_tir(cls.gemv_after_norm, (x, w_norm, w_proj), out_ty=R.Tensor((1, 4), "float32"))
            R.output(y)
        return y


@I.ir_module
class _HeadsRope:
    """projection -> reshape to heads -> a norm over each head -> rotate-half of each head (Gemma's RoPE in the
    graph: reads the other half of its head)."""

    @T.prim_func(private=True, s_tir=True)
    def gemv(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8, 8), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        for n, k in T.grid(8, 8):
            with T.sblock("gemv"):
                vn, vk = T.axis.remap("SR", [n, k])
                with T.init():
                    y[0, vn] = T.float32(0)
                y[0, vn] = y[0, vn] + w[vn, vk] * x[0, vk]

    @T.prim_func(private=True, s_tir=True)
    def reshape(y: T.Buffer((1, 8), "float32"), heads: T.Buffer((2, 4), "float32")):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        for h, d in T.grid(2, 4):
            with T.sblock("reshape"):
                vh, vd = T.axis.remap("SS", [h, d])
                heads[vh, vd] = y[0, vh * 4 + vd]

    @T.prim_func(private=True, s_tir=True)
    def head_norm(x: T.Buffer((2, 4), "float32"), y: T.Buffer((2, 4), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        sum_sq = T.sblock_alloc_buffer((2,))
        for h, d in T.grid(2, 4):
            with T.sblock("sum_sq"):
                vh, vd = T.axis.remap("SR", [h, d])
                with T.init():
                    sum_sq[vh] = T.float32(0)
                sum_sq[vh] = sum_sq[vh] + x[vh, vd] * x[vh, vd]
        for h, d in T.grid(2, 4):
            with T.sblock("norm"):
                vh, vd = T.axis.remap("SS", [h, d])
                y[vh, vd] = x[vh, vd] * T.rsqrt(sum_sq[vh])

    @T.prim_func(private=True, s_tir=True)
    def rotate(x: T.Buffer((2, 4), "float32"), y: T.Buffer((2, 4), "float32")):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        for h, d in T.grid(2, 4):
            with T.sblock("rotate"):
                vh, vd = T.axis.remap("SS", [h, d])
                y[vh, vd] = T.if_then_else(vd < 2, T.float32(0) - x[vh, vd + 2], x[vh, vd - 2])

    @R.function
    def decode(x: R.Tensor((1, 8), "float32"), params: R.Tuple(R.Tensor((8, 8), "float32"))):
        cls = _HeadsRope
        with R.dataflow():
            w = params[0]
            y = R.call_tir(cls.gemv, (x, w), out_ty=R.Tensor((1, 8), "float32"))
            heads = R.call_tir(cls.reshape, (y,), out_ty=R.Tensor((2, 4), "float32"))
            z = R.call_tir(cls.head_norm, (heads,), out_ty=R.Tensor((2, 4), "float32"))
            r = R.call_tir(cls.rotate, (z,), out_ty=R.Tensor((2, 4), "float32"))
            R.output(r)
        return r

    @R.function
    def normed_read_twice(x: R.Tensor((1, 8), "float32"), params: R.Tuple(R.Tensor((8, 8), "float32"))):
        cls = _HeadsRope
        with R.dataflow():
            w = params[0]
            y = R.call_tir(cls.gemv, (x, w), out_ty=R.Tensor((1, 8), "float32"))
            heads = R.call_tir(cls.reshape, (y,), out_ty=R.Tensor((2, 4), "float32"))
            z = R.call_tir(cls.head_norm, (heads,), out_ty=R.Tensor((2, 4), "float32"))
            r = R.call_tir(cls.rotate, (z,), out_ty=R.Tensor((2, 4), "float32"))
            R.output(z, r)
        return (z, r)


@I.ir_module
class _HeadsRopeExpected:
    """decode: one kernel, the rotation's block last, reading the normalized heads (a buffer of the kernel's own)."""

    @T.prim_func(private=True, s_tir=True)
    def gemv_then_head_norm(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8, 8), "float32"),
                            y: T.Buffer((2, 4), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        with T.sblock("root"):
            T.reads()
            T.writes()
            y_1 = T.sblock_alloc_buffer((1, 8))
            heads = T.sblock_alloc_buffer((2, 4))
            sum_sq = T.sblock_alloc_buffer((2,))
            y_2 = T.sblock_alloc_buffer((2, 4))
            for n, k in T.grid(8, 8):
                with T.sblock("gemv"):
                    vn, vk = T.axis.remap("SR", [n, k])
                    with T.init():
                        y_1[0, vn] = T.float32(0)
                    y_1[0, vn] = y_1[0, vn] + w[vn, vk] * x[0, vk]
            for h, d in T.grid(2, 4):
                with T.sblock("reshape"):
                    vh, vd = T.axis.remap("SS", [h, d])
                    heads[vh, vd] = y_1[0, vh * 4 + vd]
            for h, d in T.grid(2, 4):
                with T.sblock("sum_sq"):
                    vh, vd = T.axis.remap("SR", [h, d])
                    with T.init():
                        sum_sq[vh] = T.float32(0)
                    sum_sq[vh] = sum_sq[vh] + heads[vh, vd] * heads[vh, vd]
            for h, d in T.grid(2, 4):
                with T.sblock("norm"):
                    vh, vd = T.axis.remap("SS", [h, d])
                    y_2[vh, vd] = heads[vh, vd] * T.rsqrt(sum_sq[vh])
            for h, d in T.grid(2, 4):
                with T.sblock("rotate"):
                    vh, vd = T.axis.remap("SS", [h, d])
                    y[vh, vd] = T.if_then_else(vd < 2, T.float32(0) - y_2[vh, vd + 2], y_2[vh, vd - 2])

    @R.function
    def decode(x: R.Tensor((1, 8), "float32"), params: R.Tuple(R.Tensor((8, 8), "float32"))):
        cls = _HeadsRopeExpected
        with R.dataflow():
            w = params[0]
            r = R.call_tir(cls.gemv_then_head_norm, (x, w), out_ty=R.Tensor((2, 4), "float32"))
            R.output(r)
        return r


@I.ir_module
class _Residual:
    """post_norm_add (residual + RMSNorm of a projection's result: Gemma's post-norms) -> norm -> projection. decode:
    the residual row is read again after the projection (the next residual add); last: only by the norm (lm_head)."""

    @T.prim_func(private=True, s_tir=True)
    def post_norm_add(o: T.Buffer((1, 8), "float32"), w: T.Buffer((8,), "float32"), r: T.Buffer((1, 8), "float32"),
                      x: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        sum_sq = T.sblock_alloc_buffer((1,))
        for k in range(8):
            with T.sblock("sum_sq"):
                vk = T.axis.reduce(8, k)
                with T.init():
                    sum_sq[0] = T.float32(0)
                sum_sq[0] = sum_sq[0] + o[0, vk] * o[0, vk]
        for i in range(8):
            with T.sblock("add"):
                vi = T.axis.spatial(8, i)
                x[0, vi] = r[0, vi] + o[0, vi] * T.rsqrt(sum_sq[0]) * w[vi]

    @T.prim_func(private=True, s_tir=True)
    def norm(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8,), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        sum_sq = T.sblock_alloc_buffer((1,))
        for k in range(8):
            with T.sblock("sum_sq"):
                vk = T.axis.reduce(8, k)
                with T.init():
                    sum_sq[0] = T.float32(0)
                sum_sq[0] = sum_sq[0] + x[0, vk] * x[0, vk]
        for i in range(8):
            with T.sblock("norm"):
                vi = T.axis.spatial(8, i)
                y[0, vi] = x[0, vi] * T.rsqrt(sum_sq[0]) * w[vi]

    @T.prim_func(private=True, s_tir=True)
    def gemv(x: T.Buffer((1, 8), "float32"), w: T.Buffer((4, 8), "float32"), y: T.Buffer((1, 4), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        for n, k in T.grid(4, 8):
            with T.sblock("gemv"):
                vn, vk = T.axis.remap("SR", [n, k])
                with T.init():
                    y[0, vn] = T.float32(0)
                y[0, vn] = y[0, vn] + w[vn, vk] * x[0, vk]

    @T.prim_func(private=True, s_tir=True)
    def scale(x: T.Buffer((1, 8), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        for i in range(8):
            with T.sblock("scale"):
                vi = T.axis.spatial(8, i)
                y[0, vi] = x[0, vi] * T.float32(2)

    @R.function
    def decode(o: R.Tensor((1, 8), "float32"), r: R.Tensor((1, 8), "float32"),
               params: R.Tuple(R.Tensor((8,), "float32"), R.Tensor((8,), "float32"), R.Tensor((4, 8), "float32"))):
        cls = _Residual
        with R.dataflow():
            w_post = params[0]
            w_norm = params[1]
            w_proj = params[2]
            x = R.call_tir(cls.post_norm_add, (o, w_post, r), out_ty=R.Tensor((1, 8), "float32"))
            h = R.call_tir(cls.norm, (x, w_norm), out_ty=R.Tensor((1, 8), "float32"))
            y = R.call_tir(cls.gemv, (h, w_proj), out_ty=R.Tensor((1, 4), "float32"))
            s = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((1, 8), "float32"))
            R.output(y, s)
        return (y, s)


@I.ir_module
class _ResidualExpected:
    """One kernel: post_norm_add's blocks (its row a buffer of the kernel's own), the norm's, the projection's, then
    post_norm_add's again (variables of their own) into the kernel's first result, the row decode reads again."""

    @T.prim_func(private=True, s_tir=True)
    def gemv_after_norm_after_post_norm_add(o: T.Buffer((1, 8), "float32"), w: T.Buffer((8,), "float32"),
                                            r: T.Buffer((1, 8), "float32"), w_1: T.Buffer((8,), "float32"),
                                            w_2: T.Buffer((4, 8), "float32"), x_1: T.Buffer((1, 8), "float32"),
                                            y_1: T.Buffer((1, 4), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        with T.sblock("root"):
            T.reads()
            T.writes()
            sum_sq = T.sblock_alloc_buffer((1,))
            x = T.sblock_alloc_buffer((1, 8))
            sum_sq_1 = T.sblock_alloc_buffer((1,))
            y = T.sblock_alloc_buffer((1, 8))
            sum_sq_2 = T.sblock_alloc_buffer((1,))
            for k in range(8):
                with T.sblock("sum_sq"):
                    vk = T.axis.reduce(8, k)
                    with T.init():
                        sum_sq[0] = T.float32(0)
                    sum_sq[0] = sum_sq[0] + o[0, vk] * o[0, vk]
            for i in range(8):
                with T.sblock("add"):
                    vi = T.axis.spatial(8, i)
                    x[0, vi] = r[0, vi] + o[0, vi] * T.rsqrt(sum_sq[0]) * w[vi]
            for k in range(8):
                with T.sblock("sum_sq"):
                    vk = T.axis.reduce(8, k)
                    with T.init():
                        sum_sq_1[0] = T.float32(0)
                    sum_sq_1[0] = sum_sq_1[0] + x[0, vk] * x[0, vk]
            for i in range(8):
                with T.sblock("norm"):
                    vi = T.axis.spatial(8, i)
                    y[0, vi] = x[0, vi] * T.rsqrt(sum_sq_1[0]) * w_1[vi]
            for n, k in T.grid(4, 8):
                with T.sblock("gemv"):
                    vn, vk = T.axis.remap("SR", [n, k])
                    with T.init():
                        y_1[0, vn] = T.float32(0)
                    y_1[0, vn] = y_1[0, vn] + w_2[vn, vk] * y[0, vk]
            for k in range(8):
                with T.sblock("sum_sq"):
                    vk = T.axis.reduce(8, k)
                    with T.init():
                        sum_sq_2[0] = T.float32(0)
                    sum_sq_2[0] = sum_sq_2[0] + o[0, vk] * o[0, vk]
            for i in range(8):
                with T.sblock("add"):
                    vi = T.axis.spatial(8, i)
                    x_1[0, vi] = r[0, vi] + o[0, vi] * T.rsqrt(sum_sq_2[0]) * w[vi]

    @T.prim_func(private=True, s_tir=True)
    def scale(x: T.Buffer((1, 8), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        for i in range(8):
            with T.sblock("scale"):
                vi = T.axis.spatial(8, i)
                y[0, vi] = x[0, vi] * T.float32(2)

    @R.function
    def decode(o: R.Tensor((1, 8), "float32"), r: R.Tensor((1, 8), "float32"),
               params: R.Tuple(R.Tensor((8,), "float32"), R.Tensor((8,), "float32"), R.Tensor((4, 8), "float32"))):
        cls = _ResidualExpected
        with R.dataflow():
            w_post = params[0]
            w_norm = params[1]
            w_proj = params[2]
            results = R.call_tir(cls.gemv_after_norm_after_post_norm_add, (o, w_post, r, w_norm, w_proj),
                                 out_ty=[R.Tensor((1, 8), "float32"), R.Tensor((1, 4), "float32")])
            x = results[0]
            y = results[1]
            s = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((1, 8), "float32"))
            R.output(y, s)
        return (y, s)



@I.ir_module
class _ResidualApart:
    """last: the residual row read only by the norm (lm_head after the last layer's post-norm): it joins, no second
    result. Negative controls. read_before: the row also read before the projection, where the kernel's second result
    would not exist yet; elementwise: a producer that reduces nothing (Llama's residual add)."""

    @T.prim_func(private=True, s_tir=True)
    def post_norm_add(o: T.Buffer((1, 8), "float32"), w: T.Buffer((8,), "float32"), r: T.Buffer((1, 8), "float32"),
                      x: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        sum_sq = T.sblock_alloc_buffer((1,))
        for k in range(8):
            with T.sblock("sum_sq"):
                vk = T.axis.reduce(8, k)
                with T.init():
                    sum_sq[0] = T.float32(0)
                sum_sq[0] = sum_sq[0] + o[0, vk] * o[0, vk]
        for i in range(8):
            with T.sblock("add"):
                vi = T.axis.spatial(8, i)
                x[0, vi] = r[0, vi] + o[0, vi] * T.rsqrt(sum_sq[0]) * w[vi]

    @T.prim_func(private=True, s_tir=True)
    def add(o: T.Buffer((1, 8), "float32"), r: T.Buffer((1, 8), "float32"), x: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        for i in range(8):
            with T.sblock("add"):
                vi = T.axis.spatial(8, i)
                x[0, vi] = r[0, vi] + o[0, vi]

    @T.prim_func(private=True, s_tir=True)
    def norm(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8,), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        sum_sq = T.sblock_alloc_buffer((1,))
        for k in range(8):
            with T.sblock("sum_sq"):
                vk = T.axis.reduce(8, k)
                with T.init():
                    sum_sq[0] = T.float32(0)
                sum_sq[0] = sum_sq[0] + x[0, vk] * x[0, vk]
        for i in range(8):
            with T.sblock("norm"):
                vi = T.axis.spatial(8, i)
                y[0, vi] = x[0, vi] * T.rsqrt(sum_sq[0]) * w[vi]

    @T.prim_func(private=True, s_tir=True)
    def gemv(x: T.Buffer((1, 8), "float32"), w: T.Buffer((4, 8), "float32"), y: T.Buffer((1, 4), "float32")):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        for n, k in T.grid(4, 8):
            with T.sblock("gemv"):
                vn, vk = T.axis.remap("SR", [n, k])
                with T.init():
                    y[0, vn] = T.float32(0)
                y[0, vn] = y[0, vn] + w[vn, vk] * x[0, vk]

    @T.prim_func(private=True, s_tir=True)
    def scale(x: T.Buffer((1, 8), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        for i in range(8):
            with T.sblock("scale"):
                vi = T.axis.spatial(8, i)
                y[0, vi] = x[0, vi] * T.float32(2)

    @R.function
    def last(o: R.Tensor((1, 8), "float32"), r: R.Tensor((1, 8), "float32"),
             params: R.Tuple(R.Tensor((8,), "float32"), R.Tensor((8,), "float32"), R.Tensor((4, 8), "float32"))):
        cls = _ResidualApart
        with R.dataflow():
            w_post = params[0]
            w_norm = params[1]
            w_proj = params[2]
            x = R.call_tir(cls.post_norm_add, (o, w_post, r), out_ty=R.Tensor((1, 8), "float32"))
            h = R.call_tir(cls.norm, (x, w_norm), out_ty=R.Tensor((1, 8), "float32"))
            y = R.call_tir(cls.gemv, (h, w_proj), out_ty=R.Tensor((1, 4), "float32"))
            R.output(y)
        return y

    @R.function
    def read_before(o: R.Tensor((1, 8), "float32"), r: R.Tensor((1, 8), "float32"),
                    params: R.Tuple(R.Tensor((8,), "float32"), R.Tensor((8,), "float32"),
                                    R.Tensor((4, 8), "float32"))):
        cls = _ResidualApart
        with R.dataflow():
            w_post = params[0]
            w_norm = params[1]
            w_proj = params[2]
            x = R.call_tir(cls.post_norm_add, (o, w_post, r), out_ty=R.Tensor((1, 8), "float32"))
            h = R.call_tir(cls.norm, (x, w_norm), out_ty=R.Tensor((1, 8), "float32"))
            s = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((1, 8), "float32"))
            y = R.call_tir(cls.gemv, (h, w_proj), out_ty=R.Tensor((1, 4), "float32"))
            R.output(y, s)
        return (y, s)

    @R.function
    def elementwise(o: R.Tensor((1, 8), "float32"), r: R.Tensor((1, 8), "float32"),
                    params: R.Tuple(R.Tensor((8,), "float32"), R.Tensor((4, 8), "float32"))):
        cls = _ResidualApart
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            x = R.call_tir(cls.add, (o, r), out_ty=R.Tensor((1, 8), "float32"))
            h = R.call_tir(cls.norm, (x, w_norm), out_ty=R.Tensor((1, 8), "float32"))
            y = R.call_tir(cls.gemv, (h, w_proj), out_ty=R.Tensor((1, 4), "float32"))
            s = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((1, 8), "float32"))
            R.output(y, s)
        return (y, s)

def _fused(mod: tvm.IRModule, schedulable=lambda _: True) -> tvm.IRModule:
    return FuseGEMVNorms(schedulable)(mod)


def test_a_single_reader_producer_becomes_the_gemvs_prologue():
    tvm.ir.assert_structural_equal(_fused(_Before), _Expected)


def test_producers_read_elsewhere_reading_weights_or_reducing_nothing_stay_apart():
    tvm.ir.assert_structural_equal(_fused(_Apart), _Apart)


def test_kernels_the_schedule_does_not_take_stay_apart():
    tvm.ir.assert_structural_equal(_fused(_Before, lambda _: False), _Before)
    tvm.ir.assert_structural_equal(_fused(_Heads, lambda _: False), _Heads)


def test_a_norm_over_heads_of_the_result_becomes_the_gemvs_epilogue():
    tvm.ir.assert_structural_equal(_fused(_Heads), _HeadsExpected)


def test_results_read_elsewhere_or_followed_by_no_norm_stay_apart():
    tvm.ir.assert_structural_equal(_fused(_HeadsApart), _HeadsApart)


def test_the_cast_only_the_norm_reads_joins_the_prologue():
    tvm.ir.assert_structural_equal(_fused(_CastBefore), _CastExpected)


def test_the_norm_kernel_the_prologue_reads_joins_it_and_runs_again_into_a_second_result():
    tvm.ir.assert_structural_equal(_fused(_Residual), _ResidualExpected)
    # the schedule refuses it: the norm alone joins the projection
    refused = _fused(_Residual, lambda func: 'T.sblock("add")' not in func.script())
    assert _calls(refused, "decode") == ["post_norm_add", "gemv_after_norm", "scale"]


def test_a_residual_row_read_only_by_the_norm_joins_without_a_second_result():
    fused = _fused(_ResidualApart)
    assert _calls(fused, "last") == ["gemv_after_norm_after_post_norm_add"]
    kernel = fused["gemv_after_norm_after_post_norm_add"]
    # inputs o, w_post, r, w_norm, w_proj and the one result; post_norm_add's blocks once
    assert len(kernel.params) == 6 and kernel.script().count('T.sblock("add")') == 1


def test_a_residual_row_read_before_the_projection_or_an_elementwise_producer_stays_apart():
    fused = _fused(_ResidualApart)
    assert _calls(fused, "read_before") == ["post_norm_add", "scale", "gemv_after_norm"]
    assert _calls(fused, "elementwise") == ["add", "gemv_after_norm", "scale"]


def _calls(mod: tvm.IRModule, function: str) -> list[str]:
    names = []
    relax.analysis.post_order_visit(mod[function], lambda e: names.append(e.args[0].name_hint) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.call_tir" else None)
    return names


def test_what_only_reads_the_normalized_heads_joins_the_epilogue():
    fused = _fused(_HeadsRope)
    tvm.ir.assert_structural_equal(fused["decode"], _HeadsRopeExpected["decode"], map_free_vars=True)
    tvm.ir.assert_structural_equal(fused["gemv_then_head_norm"], _HeadsRopeExpected["gemv_then_head_norm"])
    # negative control: normalized heads that are also an output stay the norm's result; the rotation apart
    assert _calls(fused, "normed_read_twice") == ["gemv_then_head_norm1", "rotate"]
    # a rotation the schedule does not take stays apart, the norm still fused
    refused = _fused(_HeadsRope, lambda func: "rotate" not in func.script())
    assert _calls(refused, "decode") == ["gemv_then_head_norm", "rotate"]


HIDDEN, ROWS, EPS = 256, 64, 1e-5


def _norm_gemv() -> tvm.IRModule:
    """RMSNorm of x (its sum of squares, rsqrt, the normalized row) then a GEMV, float32 (PoCL has no float16): a
    decode step's input norm and QKV projection as the pass fuses them."""

    @T.prim_func(s_tir=True)
    def norm_gemv(x: T.Buffer((1, 1, HIDDEN), "float32"), norm_w: T.Buffer((HIDDEN,), "float32"),
                  w: T.Buffer((ROWS, HIDDEN), "float32"), out: T.Buffer((1, 1, ROWS), "float32")):
        T.func_attr({"global_symbol": "norm_gemv", "op_pattern": 4, "tirx.noalias": True})
        sum_sq = T.sblock_alloc_buffer((1, 1))
        rstd = T.sblock_alloc_buffer((1, 1))
        normed = T.sblock_alloc_buffer((1, 1, HIDDEN))
        for k in range(HIDDEN):
            with T.sblock("sum_sq"):
                vk = T.axis.reduce(HIDDEN, k)
                with T.init():
                    sum_sq[0, 0] = T.float32(0)
                sum_sq[0, 0] = sum_sq[0, 0] + x[0, 0, vk] * x[0, 0, vk]
        for i in range(1):
            with T.sblock("rstd"):
                vi = T.axis.spatial(1, i)
                rstd[vi, 0] = T.rsqrt(sum_sq[vi, 0] / T.float32(HIDDEN) + T.float32(EPS))
        for k in range(HIDDEN):
            with T.sblock("normed"):
                vk = T.axis.spatial(HIDDEN, k)
                normed[0, 0, vk] = rstd[0, 0] * x[0, 0, vk] * norm_w[vk]
        for n, k in T.grid(ROWS, HIDDEN):
            with T.sblock("gemv"):
                vn, vk = T.axis.remap("SR", [n, k])
                with T.init():
                    out[0, 0, vn] = T.float32(0)
                out[0, 0, vn] = out[0, 0, vn] + normed[0, 0, vk] * w[vn, vk]

    return tvm.IRModule({"norm_gemv": norm_gemv})


def _device_target(target_name: str) -> tvm.target.Target:
    device = {k: v for k, v in load_target(target_name).tvm_target_json.items() if k != "host"}
    return tvm.target.Target(device, host="llvm")


def _scheduled_norm_gemv(target_name: str) -> tvm.IRModule:
    spec = load_target(target_name)
    mod = _norm_gemv()
    with _device_target(target_name) as target:
        rule = gpu_schedules.GEMV(spec.schedule["gemv"])
        assert rule.takes(mod["norm_gemv"], target)
        return dlight.ApplyDefaultSchedule(rule)(mod)


@pytest.mark.parametrize("target_name", ["android-adreno", "android-mali"])
def test_the_norm_is_reduced_in_each_work_group_before_the_gemv(target_name):
    text = _scheduled_norm_gemv(target_name)["norm_gemv"].script()
    # the sum of squares across the K threads into shared memory, the rsqrt once per thread, the norm inlined
    assert 'sum_sq_shared = T.sblock_alloc_buffer((1, 1), scope="shared")' in text
    assert 'rstd_local = T.sblock_alloc_buffer((1, 1), scope="local")' in text
    assert 'T.sblock("normed")' not in text
    assert text.index('T.sblock("sum_sq")') < text.index('T.sblock("rstd")') < text.index('T.sblock("gemv_rf')


@NEEDS_OPENCL
def test_norm_gemv_numerics_on_opencl(tmp_path):
    """The scheduled kernel on this machine's OpenCL against numpy: a work group that read the sum of squares before
    every thread added to it, or a norm left out, is off by far more than the tolerance."""
    opencl_device.load()
    dev = tvm.opencl(0)
    # our OpenCL runtime serves kernels of a library loaded from a file (as an artifact's)
    tvm.compile(_scheduled_norm_gemv("android-adreno"), target=_device_target("android-adreno")).export_library(
        str(tmp_path / "norm_gemv.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "norm_gemv.so"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, HIDDEN)).astype("float32")
    norm_w = rng.uniform(0.5, 1.5, HIDDEN).astype("float32")
    w = rng.standard_normal((ROWS, HIDDEN)).astype("float32")
    x32 = x.reshape(-1)
    normed = x32 / np.sqrt((x32 * x32).mean() + EPS) * norm_w
    out = tvm.runtime.tensor(np.full((1, 1, ROWS), np.nan, "float32"), dev)
    lib["norm_gemv"](*(tvm.runtime.tensor(a, dev) for a in (x, norm_w, w)), out)
    got = out.numpy().reshape(-1)
    np.testing.assert_allclose(got, w @ normed, rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, w @ (x32 * norm_w), rtol=1e-2, atol=1e-2)  # negative control: no norm


HEADS, HEAD_DIM = 8, 32


def _gemv_head_norm(heads_n: int = HEADS, head_dim: int = HEAD_DIM) -> tvm.IRModule:
    """A GEMV of heads_n x head_dim rows then an RMSNorm over each head's rows, float32: a decode step's QKV
    projection and q/k norm as the pass fuses them (the reshape between them, an index map, inlined)."""
    rows = heads_n * head_dim

    @T.prim_func(s_tir=True)
    def gemv_head_norm(x: T.Buffer((1, 1, HIDDEN), "float32"), w: T.Buffer((rows, HIDDEN), "float32"),
                       head_w: T.Buffer((head_dim,), "float32"), out: T.Buffer((1, 1, heads_n, head_dim), "float32")):
        T.func_attr({"global_symbol": "gemv_head_norm", "op_pattern": 4, "tirx.noalias": True})
        y = T.sblock_alloc_buffer((1, 1, rows))
        heads = T.sblock_alloc_buffer((1, 1, heads_n, head_dim))
        sum_sq = T.sblock_alloc_buffer((1, 1, heads_n))
        for n, k in T.grid(rows, HIDDEN):
            with T.sblock("gemv"):
                vn, vk = T.axis.remap("SR", [n, k])
                with T.init():
                    y[0, 0, vn] = T.float32(0)
                y[0, 0, vn] = y[0, 0, vn] + x[0, 0, vk] * w[vn, vk]
        for h, d in T.grid(heads_n, head_dim):
            with T.sblock("reshape"):
                vh, vd = T.axis.remap("SS", [h, d])
                heads[0, 0, vh, vd] = y[0, 0, vh * head_dim + vd]
        for h, d in T.grid(heads_n, head_dim):
            with T.sblock("sum_sq"):
                vh, vd = T.axis.remap("SR", [h, d])
                with T.init():
                    sum_sq[0, 0, vh] = T.float32(0)
                sum_sq[0, 0, vh] = sum_sq[0, 0, vh] + heads[0, 0, vh, vd] * heads[0, 0, vh, vd]
        for h, d in T.grid(heads_n, head_dim):
            with T.sblock("norm"):
                vh, vd = T.axis.remap("SS", [h, d])
                out[0, 0, vh, vd] = (heads[0, 0, vh, vd] * head_w[vd]
                                     * T.rsqrt(sum_sq[0, 0, vh] / T.float32(head_dim) + T.float32(EPS)))

    return tvm.IRModule({"gemv_head_norm": gemv_head_norm})


def _scheduled_gemv_head_norm(target_name: str) -> tvm.IRModule:
    spec = load_target(target_name)
    mod = _gemv_head_norm()
    with _device_target(target_name) as target:
        rule = gpu_schedules.GEMV(spec.schedule["gemv"])
        assert rule.takes(mod["gemv_head_norm"], target)
        return dlight.ApplyDefaultSchedule(rule)(mod)


@pytest.mark.parametrize("target_name", ["android-adreno", "android-mali"])
def test_each_work_group_computes_and_normalizes_one_head(target_name):
    text = _scheduled_gemv_head_norm(target_name)["gemv_head_norm"].script()
    # one work group per head, one thread per row of it (none along K); the head's rows in shared memory, its sum
    # of squares in each thread (an allreduce)
    row_threads = load_target(target_name).schedule["gemv"]["row_threads"]
    k_threads = next(tag for tag in gpu_schedules.ROW_THREAD_TAGS if tag != row_threads)
    assert f'T.thread_binding({HEADS}, thread="blockIdx.x")' in text
    assert f'T.thread_binding({HEAD_DIM}, thread="{row_threads}")' in text
    assert f'T.thread_binding(1, thread="{k_threads}")' in text
    assert 'y_shared = T.sblock_alloc_buffer' in text and 'sum_sq_local = T.sblock_alloc_buffer' in text
    assert text.index('T.sblock("gemv_rf') < text.index('T.sblock("sum_sq")') < text.index('T.sblock("norm")')


def test_a_norm_over_the_whole_result_is_not_taken():
    """Negative control: one group of all the rows would put the whole GEMV in one work group."""
    with _device_target("android-adreno") as target:
        rule = gpu_schedules.GEMV(load_target("android-adreno").schedule["gemv"])
        assert rule.takes(_gemv_head_norm(2, HEAD_DIM * HEADS // 2)["gemv_head_norm"], target)
        assert not rule.takes(_gemv_head_norm(1, HEAD_DIM * HEADS)["gemv_head_norm"], target)


@NEEDS_OPENCL
@pytest.mark.parametrize("target_name", ["android-adreno", "android-mali"])
def test_gemv_head_norm_numerics_on_opencl(tmp_path, target_name):
    """The scheduled kernel on this machine's OpenCL against numpy: a head normalized by another head's sum, or a
    sum read before every row was in, is off by far more than the tolerance."""
    opencl_device.load()
    dev = tvm.opencl(0)
    tvm.compile(_scheduled_gemv_head_norm(target_name), target=_device_target(target_name)).export_library(
        str(tmp_path / "gemv_head_norm.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "gemv_head_norm.so"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, HIDDEN)).astype("float32")
    # heads of very different sizes: normalizing by the wrong head's sum shows
    w = (rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)) * np.repeat(np.arange(1, HEADS + 1), HEAD_DIM)[:, None]
         ).astype("float32")
    head_w = rng.uniform(0.5, 1.5, HEAD_DIM).astype("float32")
    y = (w @ x.reshape(-1)).reshape(HEADS, HEAD_DIM)
    want = y / np.sqrt((y * y).mean(axis=1, keepdims=True) + EPS) * head_w
    out = tvm.runtime.tensor(np.full((1, 1, HEADS, HEAD_DIM), np.nan, "float32"), dev)
    lib["gemv_head_norm"](*(tvm.runtime.tensor(a, dev) for a in (x, w, head_w)), out)
    got = out.numpy().reshape(HEADS, HEAD_DIM)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    whole = y / np.sqrt((y * y).mean() + EPS) * head_w  # negative control: one norm over all heads
    assert not np.allclose(got, whole, rtol=1e-2, atol=1e-2)


def _gemv_head_norm_rope() -> tvm.IRModule:
    """The GEMV + head norm of _gemv_head_norm, then RoPE's rotate-half within each head (Gemma's q/k after their
    norms): out = normed * cos + rotate_half(normed) * sin, cos and sin per position of the head."""
    rows, half = HEADS * HEAD_DIM, HEAD_DIM // 2

    @T.prim_func(s_tir=True)
    def gemv_head_norm_rope(x: T.Buffer((1, 1, HIDDEN), "float32"), w: T.Buffer((rows, HIDDEN), "float32"),
                            cos: T.Buffer((HEAD_DIM,), "float32"), sin: T.Buffer((HEAD_DIM,), "float32"),
                            out: T.Buffer((1, 1, HEADS, HEAD_DIM), "float32")):
        T.func_attr({"global_symbol": "gemv_head_norm_rope", "op_pattern": 4, "tirx.noalias": True})
        y = T.sblock_alloc_buffer((1, 1, rows))
        heads = T.sblock_alloc_buffer((1, 1, HEADS, HEAD_DIM))
        sum_sq = T.sblock_alloc_buffer((1, 1, HEADS))
        normed = T.sblock_alloc_buffer((1, 1, HEADS, HEAD_DIM))
        for n, k in T.grid(rows, HIDDEN):
            with T.sblock("gemv"):
                vn, vk = T.axis.remap("SR", [n, k])
                with T.init():
                    y[0, 0, vn] = T.float32(0)
                y[0, 0, vn] = y[0, 0, vn] + x[0, 0, vk] * w[vn, vk]
        for h, d in T.grid(HEADS, HEAD_DIM):
            with T.sblock("reshape"):
                vh, vd = T.axis.remap("SS", [h, d])
                heads[0, 0, vh, vd] = y[0, 0, vh * HEAD_DIM + vd]
        for h, d in T.grid(HEADS, HEAD_DIM):
            with T.sblock("sum_sq"):
                vh, vd = T.axis.remap("SR", [h, d])
                with T.init():
                    sum_sq[0, 0, vh] = T.float32(0)
                sum_sq[0, 0, vh] = sum_sq[0, 0, vh] + heads[0, 0, vh, vd] * heads[0, 0, vh, vd]
        for h, d in T.grid(HEADS, HEAD_DIM):
            with T.sblock("norm"):
                vh, vd = T.axis.remap("SS", [h, d])
                normed[0, 0, vh, vd] = heads[0, 0, vh, vd] * T.rsqrt(sum_sq[0, 0, vh] / T.float32(HEAD_DIM)
                                                                      + T.float32(EPS))
        for h, d in T.grid(HEADS, HEAD_DIM):
            with T.sblock("rope"):
                vh, vd = T.axis.remap("SS", [h, d])
                out[0, 0, vh, vd] = normed[0, 0, vh, vd] * cos[vd] + T.if_then_else(
                    vd < half, T.float32(0) - normed[0, 0, vh, vd + half], normed[0, 0, vh, vd - half]) * sin[vd]

    return tvm.IRModule({"gemv_head_norm_rope": gemv_head_norm_rope})


@NEEDS_OPENCL
@pytest.mark.parametrize("target_name", ["android-adreno", "android-mali"])
def test_gemv_head_norm_rope_numerics_on_opencl(tmp_path, target_name):
    """Each work group rotates the head it normalized, reading the other half of it from shared memory: a rotation
    that read the other half before it was written, or another head's, is off by far more than the tolerance."""
    spec = load_target(target_name)
    mod = _gemv_head_norm_rope()
    with _device_target(target_name) as target:
        rule = gpu_schedules.GEMV(spec.schedule["gemv"])
        assert rule.takes(mod["gemv_head_norm_rope"], target)
        mod = dlight.ApplyDefaultSchedule(rule)(mod)
    assert f'T.thread_binding({HEADS}, thread="blockIdx.x")' in mod["gemv_head_norm_rope"].script()
    opencl_device.load()
    dev = tvm.opencl(0)
    tvm.compile(mod, target=_device_target(target_name)).export_library(str(tmp_path / "rope.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "rope.so"))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 1, HIDDEN)).astype("float32")
    w = (rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)) * np.repeat(np.arange(1, HEADS + 1), HEAD_DIM)[:, None]
         ).astype("float32")
    angles = rng.uniform(0, 2 * np.pi, HEAD_DIM).astype("float32")
    cos, sin = np.cos(angles), np.sin(angles)
    y = (w @ x.reshape(-1)).reshape(HEADS, HEAD_DIM)
    normed = y / np.sqrt((y * y).mean(axis=1, keepdims=True) + EPS)
    half = HEAD_DIM // 2
    want = normed * cos + np.concatenate([-normed[:, half:], normed[:, :half]], axis=1) * sin
    out = tvm.runtime.tensor(np.full((1, 1, HEADS, HEAD_DIM), np.nan, "float32"), dev)
    lib["gemv_head_norm_rope"](*(tvm.runtime.tensor(a, dev) for a in (x, w, cos, sin)), out)
    got = out.numpy().reshape(HEADS, HEAD_DIM)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, normed * cos + normed * sin, rtol=1e-2, atol=1e-2)  # negative control: no rotation


def _residual_norm_gemv() -> tvm.IRModule:
    """A post-norm with its residual add (x = r + RMSNorm(o) * w_post), RMSNorm of x, a GEMV, then the post-norm again
    into a second result, float32: Gemma's gate/up projection as the pass fuses it with both norms before it."""

    @T.prim_func(s_tir=True)
    def residual_norm_gemv(o: T.Buffer((1, 1, HIDDEN), "float32"), w_post: T.Buffer((HIDDEN,), "float32"),
                           r: T.Buffer((1, 1, HIDDEN), "float32"), norm_w: T.Buffer((HIDDEN,), "float32"),
                           w: T.Buffer((ROWS, HIDDEN), "float32"), x_out: T.Buffer((1, 1, HIDDEN), "float32"),
                           out: T.Buffer((1, 1, ROWS), "float32")):
        T.func_attr({"global_symbol": "residual_norm_gemv", "op_pattern": 4, "tirx.noalias": True})
        o_sum_sq = T.sblock_alloc_buffer((1, 1))
        x = T.sblock_alloc_buffer((1, 1, HIDDEN))
        sum_sq = T.sblock_alloc_buffer((1, 1))
        normed = T.sblock_alloc_buffer((1, 1, HIDDEN))
        o_sum_sq_again = T.sblock_alloc_buffer((1, 1))
        for k in range(HIDDEN):
            with T.sblock("o_sum_sq"):
                vk = T.axis.reduce(HIDDEN, k)
                with T.init():
                    o_sum_sq[0, 0] = T.float32(0)
                o_sum_sq[0, 0] = o_sum_sq[0, 0] + o[0, 0, vk] * o[0, 0, vk]
        for k in range(HIDDEN):
            with T.sblock("residual"):
                vk = T.axis.spatial(HIDDEN, k)
                x[0, 0, vk] = r[0, 0, vk] + o[0, 0, vk] * T.rsqrt(o_sum_sq[0, 0] / T.float32(HIDDEN) + T.float32(EPS)
                                                                   ) * w_post[vk]
        for k in range(HIDDEN):
            with T.sblock("sum_sq"):
                vk = T.axis.reduce(HIDDEN, k)
                with T.init():
                    sum_sq[0, 0] = T.float32(0)
                sum_sq[0, 0] = sum_sq[0, 0] + x[0, 0, vk] * x[0, 0, vk]
        for k in range(HIDDEN):
            with T.sblock("normed"):
                vk = T.axis.spatial(HIDDEN, k)
                normed[0, 0, vk] = x[0, 0, vk] * T.rsqrt(sum_sq[0, 0] / T.float32(HIDDEN) + T.float32(EPS)) * norm_w[vk]
        for n, k in T.grid(ROWS, HIDDEN):
            with T.sblock("gemv"):
                vn, vk = T.axis.remap("SR", [n, k])
                with T.init():
                    out[0, 0, vn] = T.float32(0)
                out[0, 0, vn] = out[0, 0, vn] + normed[0, 0, vk] * w[vn, vk]
        for k in range(HIDDEN):
            with T.sblock("o_sum_sq_again"):
                vk = T.axis.reduce(HIDDEN, k)
                with T.init():
                    o_sum_sq_again[0, 0] = T.float32(0)
                o_sum_sq_again[0, 0] = o_sum_sq_again[0, 0] + o[0, 0, vk] * o[0, 0, vk]
        for k in range(HIDDEN):
            with T.sblock("residual_again"):
                vk = T.axis.spatial(HIDDEN, k)
                x_out[0, 0, vk] = r[0, 0, vk] + o[0, 0, vk] * T.rsqrt(
                    o_sum_sq_again[0, 0] / T.float32(HIDDEN) + T.float32(EPS)) * w_post[vk]

    return tvm.IRModule({"residual_norm_gemv": residual_norm_gemv})


def _scheduled_residual_norm_gemv(target_name: str) -> tvm.IRModule:
    spec = load_target(target_name)
    mod = _residual_norm_gemv()
    with _device_target(target_name) as target:
        rule = gpu_schedules.GEMV(spec.schedule["gemv"])
        assert rule.takes(mod["residual_norm_gemv"], target)
        return dlight.ApplyDefaultSchedule(rule)(mod)


@pytest.mark.parametrize("target_name", ["android-adreno", "android-mali"])
def test_the_second_run_writes_its_result_from_the_first_work_group_only(target_name):
    text = _scheduled_residual_norm_gemv(target_name)["residual_norm_gemv"].script()
    # both row reductions before the GEMV, the second run's after it: its sum (whole in each thread, no barrier) and
    # its result, and nothing else, predicated on the first work group
    assert (text.index('T.sblock("o_sum_sq")') < text.index('T.sblock("sum_sq")') < text.index('T.sblock("gemv_rf')
            < text.index('T.sblock("o_sum_sq_again")') < text.index('T.sblock("residual_again")'))
    assert 'o_sum_sq_again_local = T.sblock_alloc_buffer((1, 1), scope="local")' in text
    work_group = re.search(r'for (\w+) in T.thread_binding\(\d+, thread="blockIdx.x"\)', text).group(1)
    predicates = [(m.start(), m.group(1)) for m in re.finditer(r"T.where\((.*)\)", text)]
    assert [p for _, p in predicates] == [f"{work_group} == 0"] * 2, predicates
    assert text.index('T.sblock("o_sum_sq_again")') < predicates[0][0] < text.index('T.sblock("residual_again")')
    assert text.index('T.sblock("residual_again")') < predicates[1][0]
    assert 'T.sblock("residual")' not in text and 'T.sblock("normed")' not in text  # inlined into their readers


@NEEDS_OPENCL
@pytest.mark.parametrize("target_name", ["android-adreno", "android-mali"])
def test_residual_norm_gemv_numerics_on_opencl(tmp_path, target_name):
    """The scheduled kernel on this machine's OpenCL against numpy: the GEMV of the twice-normalized row, and the
    residual row written whole (its buffer starts as NaN: a value no work group wrote stays NaN)."""
    opencl_device.load()
    dev = tvm.opencl(0)
    tvm.compile(_scheduled_residual_norm_gemv(target_name), target=_device_target(target_name)).export_library(
        str(tmp_path / "residual.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "residual.so"))
    rng = np.random.default_rng(2)
    o, r = (rng.standard_normal((1, 1, HIDDEN)).astype("float32") for _ in range(2))
    w_post, norm_w = (rng.uniform(0.5, 1.5, HIDDEN).astype("float32") for _ in range(2))
    w = rng.standard_normal((ROWS, HIDDEN)).astype("float32")

    def rms_norm(v, weight):
        return v / np.sqrt((v * v).mean() + EPS) * weight

    x = r.reshape(-1) + rms_norm(o.reshape(-1), w_post)
    x_out = tvm.runtime.tensor(np.full((1, 1, HIDDEN), np.nan, "float32"), dev)
    out = tvm.runtime.tensor(np.full((1, 1, ROWS), np.nan, "float32"), dev)
    lib["residual_norm_gemv"](*(tvm.runtime.tensor(a, dev) for a in (o, w_post, r, norm_w, w)), x_out, out)
    np.testing.assert_allclose(x_out.numpy().reshape(-1), x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.numpy().reshape(-1), w @ rms_norm(x, norm_w), rtol=1e-4, atol=1e-4)
    # negative control: without the post-norm (the residual plus the raw projection)
    assert not np.allclose(out.numpy().reshape(-1), w @ rms_norm(r.reshape(-1) + o.reshape(-1), norm_w),
                           rtol=1e-2, atol=1e-2)
