"""VloadHalf: float16 scales read with vload_half and computed on in float32, IR in / IR out; a GPU-scheduled
decode GEMV with GGUF Q4_1 scales and mins (float16) runs on PoCL, which has no cl_khr_fp16, and matches numpy;
without the pass PoCL refuses the same kernel (negative control)."""

import numpy as np
import pytest
import tvm
from tvm import te, tirx
from tvm.s_tir import dlight
from tvm.script import tirx as T

from compiler.errors import MobilecError
from compiler.passes.vload_half import VloadHalf, drop_fp16_extension, opencl_half_pointers
from compiler.quantization import group
from compiler.quantization.dequantize_te import dequantize_te
from compiler.quantization.gguf_blocks import LAYOUTS
from compiler.schedules import gpu as gpu_schedules
from compiler.target.targets import load_target, with_overrides


@T.prim_func(private=True, s_tir=True)
def _before(scale: T.Buffer((4, 2), "float16"), w: T.Buffer((4, 64), "float32"), out: T.Buffer((4, 64), "float32")):
    scale_local = T.sblock_alloc_buffer((4, 2), "float16", scope="local")
    for i, g in T.grid(4, 2):
        with T.sblock("scale_local"):
            vi, vg = T.axis.remap("SS", [i, g])
            T.reads(scale[vi, vg])
            T.writes(scale_local[vi, vg])
            scale_local[vi, vg] = scale[vi, vg]
    for i, k in T.grid(4, 64):
        with T.sblock("dequantize"):
            vi, vk = T.axis.remap("SS", [i, k])
            T.reads(scale_local[vi, vk // 32], w[vi, vk], scale[vi, vk // 32])
            T.writes(out[vi, vk])
            out[vi, vk] = (T.Cast("float32", scale_local[vi, vk // 32]) * w[vi, vk]
                           + T.Cast("float32", scale[vi, vk // 32]))


@T.prim_func(private=True, s_tir=True)
def _expected(scale: T.Buffer((4, 2), "float16"), w: T.Buffer((4, 64), "float32"), out: T.Buffer((4, 64), "float32")):
    scale_local = T.sblock_alloc_buffer((4, 2), scope="local")
    for i, g in T.grid(4, 2):
        with T.sblock("scale_local"):
            vi, vg = T.axis.remap("SS", [i, g])
            T.reads(scale[vi, vg])
            T.writes(scale_local[vi, vg])
            scale_local[vi, vg] = T.call_pure_extern("float32", "vload_half", vi * 2 + vg, scale.data)
    for i, k in T.grid(4, 64):
        with T.sblock("dequantize"):
            vi, vk = T.axis.remap("SS", [i, k])
            T.reads(scale_local[vi, vk // 32], w[vi, vk], scale[vi, vk // 32])
            T.writes(out[vi, vk])
            out[vi, vk] = (scale_local[vi, vk // 32] * w[vi, vk]
                           + T.call_pure_extern("float32", "vload_half", vi * 2 + vk // 32, scale.data))


@T.prim_func(private=True, s_tir=True)
def _float32_only(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
    for i in range(8):
        with T.sblock("copy"):
            vi = T.axis.remap("S", [i])
            b[vi] = a[vi]


@T.prim_func(private=True, s_tir=True)
def _stores_half(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float16")):
    for i in range(8):
        with T.sblock("narrow"):
            vi = T.axis.remap("S", [i])
            b[vi] = T.Cast("float16", a[vi])


@T.prim_func(private=True, s_tir=True)
def _squares_half(a: T.Buffer((8,), "float16"), b: T.Buffer((8,), "float32")):
    for i in range(8):
        with T.sblock("square"):
            vi = T.axis.remap("S", [i])
            b[vi] = T.Cast("float32", a[vi] * a[vi])


def test_ir_in_ir_out():
    tvm.ir.assert_structural_equal(VloadHalf()(tvm.IRModule({"dequantize": _before})),
                                   tvm.IRModule({"dequantize": _expected}))


def test_float32_kernels_are_left_as_they_are():
    mod = tvm.IRModule({"copy": _float32_only})
    assert VloadHalf()(mod)["copy"].same_as(_float32_only)


def test_float16_stores_and_arithmetic_are_refused_by_kernel():
    with pytest.raises(MobilecError, match=r"kernel narrow writes the float16 buffer b, which needs cl_khr_fp16"):
        VloadHalf()(tvm.IRModule({"narrow": _stores_half}))
    with pytest.raises(MobilecError, match=r"kernel square computes on float16 values .* q4f32_g32\)$"):
        VloadHalf()(tvm.IRModule({"square": _squares_half}))


_EXTENSION = ('#ifdef cl_khr_fp16\n#pragma OPENCL EXTENSION cl_khr_fp16 : enable\n#elif defined(cl_amd_fp16)\n'
              '#pragma OPENCL EXTENSION cl_amd_fp16 : enable\n#else\n'
              '#error "Half precision floating point not supported by OpenCL implementation on your device." \n'
              '#endif\n\n')


def test_the_fp16_extension_goes_only_where_half_is_a_pointer_target():
    pointer_only = _EXTENSION + "__kernel void k(__global half* s, __global float* o) { o[0] = vload_half(0, s); }"
    arithmetic = _EXTENSION + "__kernel void k(__global half* s, __global half* o) { half x = s[0]; o[0] = x; }"
    assert drop_fp16_extension(pointer_only) == pointer_only.removeprefix(_EXTENSION)
    assert drop_fp16_extension(arithmetic) == arithmetic


# A decode GEMV in GGUF's Q4_1 layout (float16 scale d and min m per 32 codes), as SmolLM2's gguf artifact has.
N, K = 64, 256
LAYOUT = LAYOUTS["Q4_1"]


def _q4_1_gemv() -> tirx.PrimFunc:
    q = te.placeholder((N, K // 2), "uint8", name="q_weight")
    scale = te.placeholder((N, K // 32), "float16", name="q_scale")
    minv = te.placeholder((N, K // 32), "float16", name="q_min")
    x = te.placeholder((1, K), "float32", name="x")
    w = dequantize_te(LAYOUT, K, "float32")(q, scale, minv)
    k = te.reduce_axis((0, K), name="k")
    y = te.compute((1, N), lambda i, j: te.sum(x[i, k] * w[j, k], axis=k), name="y")
    return te.create_prim_func([q, scale, minv, x, y])


def _scheduled_for_pocl(vload_half: bool) -> tuple[tirx.PrimFunc, tvm.target.Target]:
    spec = with_overrides(load_target("android-adreno"), compute_dtype="float32")
    with spec.tvm_target():
        mod = dlight.ApplyDefaultSchedule(*gpu_schedules.rules(spec.schedule))(tvm.IRModule({"main": _q4_1_gemv()}))
        if vload_half:
            mod = VloadHalf()(mod)
    return mod["main"], spec.tvm_target()


def test_q4_1_gemv_with_float16_scales_runs_on_pocl_and_matches_numpy():
    pocl = pytest.importorskip("compiler.testing.pocl")
    try:
        pocl._context()  # pylint: disable=protected-access
    except Exception:  # noqa: BLE001 - no ICD, no platform
        pytest.skip("PoCL missing: apt-get install pocl-opencl-icd")
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(N, K)).astype(np.uint8)
    d = (rng.random((N, K // 32)) * 0.02 + 0.001).astype(np.float16)
    m = (-rng.random((N, K // 32)) * 0.1).astype(np.float16)
    x = rng.standard_normal((1, K)).astype(np.float32)
    arrays = {"q_weight": group.pack_codes(codes, 4), "q_scale": d, "q_min": m}

    def gemv(scales):  # w = code * d + m, one d and m per 32 codes along K
        per_code = [np.repeat(s.astype(np.float32), 32, axis=1) for s in scales]
        return x @ (codes * per_code[0] + per_code[1]).T

    want = gemv((d, m))

    func, target = _scheduled_for_pocl(vload_half=True)
    with opencl_half_pointers():
        build = pocl.build_opencl(func, target)
    assert "vload_half" in build.source and "cl_khr_fp16" not in build.source
    args = [arrays["q_weight"], d, m, x, np.zeros((1, N), np.float32)]
    got = pocl.run_pocl(build, args, {})[-1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Negative controls: the comparison sees the scales (each row's d of the next row instead), and the same
    # kernel without the pass needs fp16 arithmetic, which PoCL refuses to build.
    assert np.abs(gemv((np.roll(d, 1, axis=0), m)) - got).max() > 1e-2
    func, target = _scheduled_for_pocl(vload_half=False)
    with opencl_half_pointers():
        build = pocl.build_opencl(func, target)
    with pytest.raises(Exception, match="Half precision floating point not supported"):
        pocl.run_pocl(build, args, {})
