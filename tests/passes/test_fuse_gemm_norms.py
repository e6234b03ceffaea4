"""FuseGEMMNorms: IR in/IR out (Before/Expected) for the RMSNorm before a prefill GEMM, the kernels it must leave
alone (negative controls), the GPU Matmul rule on the fused kernel (each thread reduces the rows it multiplies), and
its numerics on this machine's OpenCL against numpy over more rows than one work group's tile, with and without a
norm over each head of the GEMM's columns after it (Qwen3's q/k norm)."""

import numpy as np
import pytest
import tvm
from tvm.s_tir import dlight
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.passes.fuse_gemm_norms import FuseGEMMNorms
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


def _fused(mod: tvm.IRModule, schedulable=lambda _: True) -> tvm.IRModule:
    return FuseGEMMNorms(schedulable)(mod)


def test_the_norm_a_prefill_gemm_alone_reads_becomes_its_prologue():
    tvm.ir.assert_structural_equal(_fused(_Before), _Expected)


def test_norms_read_elsewhere_decode_shapes_and_elementwise_producers_stay_apart():
    tvm.ir.assert_structural_equal(_fused(_Apart), _Apart)


def test_kernels_the_schedule_does_not_take_stay_apart():
    tvm.ir.assert_structural_equal(_fused(_Before, lambda _: False), _Before)


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


HEADS, HEAD_DIM = 8, 32  # the tiles' columns (256 on android-adreno, 64 on android-mali) whole heads


def _norm_gemm_head_norm() -> tvm.IRModule:
    """_norm_gemm's kernel with, after the GEMM, its columns as heads (the reshape's generic flat index) and an
    RMSNorm over each head's columns: Qwen3's QKV projection with its q/k norm as the pass fuses them."""
    columns = HEADS * HEAD_DIM

    @T.prim_func(s_tir=True)
    def norm_gemm_head_norm(var_x: T.handle, norm_w: T.Buffer((HIDDEN,), "float32"),
                            w: T.Buffer((columns, HIDDEN), "float32"), head_w: T.Buffer((HEAD_DIM,), "float32"),
                            var_out: T.handle):
        T.func_attr({"global_symbol": "norm_gemm_head_norm", "op_pattern": 4, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, HIDDEN))
        out = T.match_buffer(var_out, (n, HEADS, HEAD_DIM))
        sum_sq = T.sblock_alloc_buffer((n,))
        rstd = T.sblock_alloc_buffer((n,))
        normed = T.sblock_alloc_buffer((n, HIDDEN))
        y = T.sblock_alloc_buffer((n, columns))
        heads = T.sblock_alloc_buffer((n, HEADS, HEAD_DIM))
        head_sum_sq = T.sblock_alloc_buffer((n, HEADS))
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
        for r, c, k in T.grid(n, T.int64(columns), T.int64(HIDDEN)):
            with T.sblock("gemm"):
                vr, vc, vk = T.axis.remap("SSR", [r, c, k])
                with T.init():
                    y[vr, vc] = T.float32(0)
                y[vr, vc] = y[vr, vc] + normed[vr, vk] * w[vc, vk]
        for r, h, d in T.grid(n, T.int64(HEADS), T.int64(HEAD_DIM)):
            with T.sblock("reshape"):
                vr, vh, vd = T.axis.remap("SSS", [r, h, d])
                heads[vr, vh, vd] = y[((vh * T.int64(HEAD_DIM) + vd) // T.int64(columns) + vr) % n,
                                      (vh * T.int64(HEAD_DIM) + vd) % T.int64(columns)]
        for r, h, d in T.grid(n, T.int64(HEADS), T.int64(HEAD_DIM)):
            with T.sblock("head_sum_sq"):
                vr, vh, vd = T.axis.remap("SSR", [r, h, d])
                with T.init():
                    head_sum_sq[vr, vh] = T.float32(0)
                head_sum_sq[vr, vh] = head_sum_sq[vr, vh] + heads[vr, vh, vd] * heads[vr, vh, vd]
        for r, h, d in T.grid(n, T.int64(HEADS), T.int64(HEAD_DIM)):
            with T.sblock("head_norm"):
                vr, vh, vd = T.axis.remap("SSS", [r, h, d])
                out[vr, vh, vd] = heads[vr, vh, vd] * head_w[vd] * T.rsqrt(
                    head_sum_sq[vr, vh] / T.float32(HEAD_DIM) + T.float32(EPS))

    return tvm.IRModule({"norm_gemm_head_norm": norm_gemm_head_norm})


@NEEDS_OPENCL
@pytest.mark.parametrize("target_name", ["android-adreno", "android-mali"])
def test_norm_gemm_head_norm_numerics_on_opencl(tmp_path, target_name):
    """The scheduled kernel with the head norm on this machine's OpenCL against numpy, 29 rows: the last tile of rows
    partly past the sequence on either target."""
    opencl_device.load()
    dev = tvm.opencl(0)
    mod = _norm_gemm_head_norm()
    with _device_target(target_name) as target:
        rule = gpu_schedules.Matmul(load_target(target_name).schedule["matmul"])
        assert rule.takes(mod["norm_gemm_head_norm"], target)
        scheduled = dlight.ApplyDefaultSchedule(rule)(mod)
    tvm.compile(scheduled, target=_device_target(target_name)).export_library(str(tmp_path / "kernel.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "kernel.so"))
    rng = np.random.default_rng(0)
    rows = 29
    x = rng.standard_normal((rows, HIDDEN)).astype("float32")
    norm_w = rng.uniform(0.5, 1.5, HIDDEN).astype("float32")
    w = rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype("float32")
    head_w = rng.uniform(0.5, 1.5, HEAD_DIM).astype("float32")
    y = (x / np.sqrt((x * x).mean(axis=1, keepdims=True) + EPS) * norm_w) @ w.T
    heads = y.reshape(rows, HEADS, HEAD_DIM)
    expected = heads / np.sqrt((heads * heads).mean(axis=2, keepdims=True) + EPS) * head_w
    out = tvm.runtime.tensor(np.full((rows, HEADS, HEAD_DIM), np.nan, "float32"), dev)
    lib["norm_gemm_head_norm"](*(tvm.runtime.tensor(a, dev) for a in (x, norm_w, w, head_w)), out)
    got = out.numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, heads * head_w, rtol=1e-2, atol=1e-2)  # negative control: no head norm
