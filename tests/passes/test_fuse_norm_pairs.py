"""FuseNormPairs: IR in/IR out (Before/Expected) for a norm kernel that alone reads another's result (Gemma 3's last
post-feedforward norm with its residual add, then the final norm), the pairs it must leave alone (negative controls),
and the pair's kernel on this machine's OpenCL against the two kernels apart and numpy."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.s_tir import dlight
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.passes.fuse_norm_pairs import FuseNormPairs
from compiler.runtime import opencl_device
from compiler.schedules import gpu as gpu_schedules
from compiler.target.targets import load_target
from tests.helpers.pocl_device import NEEDS_OPENCL

HIDDEN, EPS = 64, 1e-5


@I.ir_module
class _Before:
    """post-norm with its residual add -> the final norm, which alone reads its result -> the last row (no norm), each
    kernel with its own length variable."""

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
        m = T.int64()
        x = T.match_buffer(var_x, (m, HIDDEN))
        y = T.match_buffer(var_y, (m, HIDDEN))
        sum_sq = T.sblock_alloc_buffer((m,))
        for r, k in T.grid(m, T.int64(HIDDEN)):
            with T.sblock("sum_sq"):
                vr, vk = T.axis.remap("SR", [r, k])
                with T.init():
                    sum_sq[vr] = T.float32(0)
                sum_sq[vr] = sum_sq[vr] + x[vr, vk] * x[vr, vk]
        for r, k in T.grid(m, T.int64(HIDDEN)):
            with T.sblock("norm"):
                vr, vk = T.axis.remap("SS", [r, k])
                y[vr, vk] = x[vr, vk] * T.rsqrt(sum_sq[vr] / T.float32(HIDDEN) + T.float32(EPS)) * w[vk]

    @T.prim_func(private=True, s_tir=True)
    def last_row(var_x: T.handle, y: T.Buffer((1, HIDDEN), "float32")):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, HIDDEN))
        for i, k in T.grid(1, T.int64(HIDDEN)):
            with T.sblock("last_row"):
                vi, vk = T.axis.remap("SS", [i, k])
                y[vi, vk] = x[m - T.int64(1), vk]

    @R.function
    def prefill(o: R.Tensor(("seq_len", HIDDEN), "float32"), res: R.Tensor(("seq_len", HIDDEN), "float32"),
                params: R.Tuple(R.Tensor((HIDDEN,), "float32"), R.Tensor((HIDDEN,), "float32"))):
        seq_len = T.int64()
        cls = _Before
        with R.dataflow():
            w_post = params[0]
            w_norm = params[1]
            h = R.call_tir(cls.post_norm_add, (o, res, w_post), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            x = R.call_tir(cls.norm, (h, w_norm), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            y = R.call_tir(cls.last_row, (x,), out_ty=R.Tensor((1, HIDDEN), "float32"))
            R.output(y)
        return y


@I.ir_module
class _Expected:
    """The pair as one kernel in the first kernel's length variable: its blocks, its result a buffer of the kernel's
    own, then the final norm's; the last row as before."""

    @T.prim_func(private=True, s_tir=True)
    def norm_after_post_norm_add(var_o: T.handle, var_res: T.handle, w: T.Buffer((HIDDEN,), "float32"),
                                 w_1: T.Buffer((HIDDEN,), "float32"), var_y: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        n = T.int64()
        o = T.match_buffer(var_o, (n, HIDDEN))
        res = T.match_buffer(var_res, (n, HIDDEN))
        y = T.match_buffer(var_y, (n, HIDDEN))
        h = T.sblock_alloc_buffer((n, HIDDEN))
        sum_sq = T.sblock_alloc_buffer((n,))
        sum_sq_1 = T.sblock_alloc_buffer((n,))
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
        for r, k in T.grid(n, T.int64(HIDDEN)):
            with T.sblock("sum_sq"):
                vr, vk = T.axis.remap("SR", [r, k])
                with T.init():
                    sum_sq_1[vr] = T.float32(0)
                sum_sq_1[vr] = sum_sq_1[vr] + h[vr, vk] * h[vr, vk]
        for r, k in T.grid(n, T.int64(HIDDEN)):
            with T.sblock("norm"):
                vr, vk = T.axis.remap("SS", [r, k])
                y[vr, vk] = h[vr, vk] * T.rsqrt(sum_sq_1[vr] / T.float32(HIDDEN) + T.float32(EPS)) * w_1[vk]

    @T.prim_func(private=True, s_tir=True)
    def last_row(var_x: T.handle, y: T.Buffer((1, HIDDEN), "float32")):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, HIDDEN))
        for i, k in T.grid(1, T.int64(HIDDEN)):
            with T.sblock("last_row"):
                vi, vk = T.axis.remap("SS", [i, k])
                y[vi, vk] = x[m - T.int64(1), vk]

    @R.function
    def prefill(o: R.Tensor(("seq_len", HIDDEN), "float32"), res: R.Tensor(("seq_len", HIDDEN), "float32"),
                params: R.Tuple(R.Tensor((HIDDEN,), "float32"), R.Tensor((HIDDEN,), "float32"))):
        seq_len = T.int64()
        cls = _Expected
        with R.dataflow():
            w_post = params[0]
            w_norm = params[1]
            x = R.call_tir(cls.norm_after_post_norm_add, (o, res, w_post, w_norm),
                           out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            y = R.call_tir(cls.last_row, (x,), out_ty=R.Tensor((1, HIDDEN), "float32"))
            R.output(y)
        return y


@I.ir_module
class _Apart:
    """Negative controls. shared: the first norm's result is also read by the last row; elementwise: the final norm
    reads a kernel that reduces nothing."""

    @T.prim_func(private=True, s_tir=True)
    def norm(var_x: T.handle, var_y: T.handle):
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
                y[vr, vk] = x[vr, vk] * T.rsqrt(sum_sq[vr] / T.float32(HIDDEN) + T.float32(EPS))

    @T.prim_func(private=True, s_tir=True)
    def double(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, HIDDEN))
        y = T.match_buffer(var_y, (n, HIDDEN))
        for r, k in T.grid(n, T.int64(HIDDEN)):
            with T.sblock("double"):
                vr, vk = T.axis.remap("SS", [r, k])
                y[vr, vk] = x[vr, vk] * T.float32(2)

    @R.function
    def shared(x: R.Tensor(("seq_len", HIDDEN), "float32")):
        seq_len = T.int64()
        cls = _Apart
        with R.dataflow():
            h = R.call_tir(cls.norm, (x,), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            y = R.call_tir(cls.norm, (h,), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            z = R.call_tir(cls.double, (h,), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            gv = (y, z)
            R.output(gv)
        return gv

    @R.function
    def elementwise(x: R.Tensor(("seq_len", HIDDEN), "float32")):
        seq_len = T.int64()
        cls = _Apart
        with R.dataflow():
            h = R.call_tir(cls.double, (x,), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            y = R.call_tir(cls.norm, (h,), out_ty=R.Tensor((seq_len, HIDDEN), "float32"))
            R.output(y)
        return y


def _fused(mod: tvm.IRModule, schedulable=lambda _: True) -> tvm.IRModule:
    return FuseNormPairs(schedulable)(mod)


def test_a_norm_alone_reading_another_runs_it_first():
    tvm.ir.assert_structural_equal(_fused(_Before), _Expected)


def test_shared_results_and_elementwise_producers_stay_apart():
    tvm.ir.assert_structural_equal(_fused(_Apart), _Apart)


def test_a_pair_the_schedule_does_not_take_stays_apart():
    tvm.ir.assert_structural_equal(_fused(_Before, lambda _: False), _Before)


def _device_target(target_name: str) -> tvm.target.Target:
    device = {k: v for k, v in load_target(target_name).tvm_target_json.items() if k != "host"}
    return tvm.target.Target(device, host="llvm")


def _kernels(mod: tvm.IRModule, names: list[str], target_name: str) -> tvm.runtime.Module:
    """The PrimFuncs `names` of `mod`, scheduled by the GPU rules as compile does, built for `target_name`."""
    spec = load_target(target_name)
    kernels = tvm.IRModule({name: mod[name].with_attr("global_symbol", name) for name in names})
    with _device_target(target_name) as target:
        scheduled = dlight.ApplyDefaultSchedule(*gpu_schedules.rules(spec.schedule))(kernels)
    assert all(scheduled[name].attrs["tirx.is_scheduled"] for name in names)
    return tvm.compile(scheduled, target=target)


@NEEDS_OPENCL
@pytest.mark.parametrize("target_name", ["android-adreno", pytest.param("android-mali", marks=pytest.mark.extended)])
def test_pair_numerics_on_opencl(tmp_path, target_name):
    """The pair's kernel on this machine's OpenCL, 37 rows, against the two kernels apart (the unfused build's) and
    numpy; without the post-norm it is off by far more than the tolerance (negative control)."""
    opencl_device.load()
    dev = tvm.opencl(0)
    # our OpenCL runtime serves kernels of a library loaded from a file (as an artifact's)
    built = {}
    for label, mod, names in (("apart", _Before, ["post_norm_add", "norm"]),
                              ("pair", _fused(_Before), ["norm_after_post_norm_add"])):
        _kernels(mod, names, target_name).export_library(str(tmp_path / f"{label}.so"))
        built[label] = tvm.runtime.load_module(str(tmp_path / f"{label}.so"))
    rng = np.random.default_rng(0)
    rows = 37
    o, res = (rng.standard_normal((rows, HIDDEN)).astype("float32") for _ in range(2))
    w_post, w_norm = (rng.uniform(0.5, 1.5, HIDDEN).astype("float32") for _ in range(2))
    args = [tvm.runtime.tensor(a, dev) for a in (o, res, w_post, w_norm)]

    def empty():
        return tvm.runtime.tensor(np.full((rows, HIDDEN), np.nan, "float32"), dev)

    h, apart, pair = empty(), empty(), empty()
    built["apart"]["post_norm_add"](*args[:3], h)
    built["apart"]["norm"](h, args[3], apart)
    built["pair"]["norm_after_post_norm_add"](*args, pair)

    def rms_norm(x, weight):
        return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + EPS) * weight

    np.testing.assert_allclose(pair.numpy(), apart.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pair.numpy(), rms_norm(res + rms_norm(o, w_post), w_norm), rtol=1e-5, atol=1e-5)
    assert not np.allclose(pair.numpy(), rms_norm(res + o, w_norm), rtol=1e-2, atol=1e-2)
