"""VloadHalf: reads of float16 buffers become OpenCL's vload_half (float32), float16 locals become float32."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import tvm
import tvm_ffi
from tvm import tirx

from ..errors import MobilecError

_HALF = "float16"
_GLOBAL_SCOPES = ("global", "")
# TVM's OpenCL codegen puts this before any kernel that prints the type half, pointers included.
_FP16_EXTENSION = re.compile(
    r"#ifdef cl_khr_fp16\n#pragma OPENCL EXTENSION cl_khr_fp16 : enable\n#elif defined\(cl_amd_fp16\)\n"
    r"#pragma OPENCL EXTENSION cl_amd_fp16 : enable\n#else\n#error [^\n]*\n#endif\n\n?")
_HALF_VALUE = re.compile(r"\bhalf\d*\b(?!\s*\*)")  # half, halfN not followed by `*`: a value, not a pointer
_POSTPROC_HOOK = "tvm_callback_opencl_postproc"
_FIX = ("which needs cl_khr_fp16: with --compute-dtype float32 use a scheme whose float16 arrays are only read "
        "(q4f16_*, gguf), or float32 throughout (q0f32, q4f32_g32)")


def _is_half(dtype) -> bool:
    return str(dtype).startswith(_HALF)


def _global_half_buffer(buf) -> bool:
    return tirx.is_buffer_var(buf) and _is_half(buf.ty.dtype.dtype) and buf.ty.storage_scope in _GLOBAL_SCOPES


@tvm.transform.module_pass(opt_level=0, name="VloadHalf")
class VloadHalf:  # pylint: disable=too-few-public-methods
    """For a device that computes in float32 but keeps weights' scales (and GGUF mins) in float16 and has no
    cl_khr_fp16 (PoCL 3.1 here): OpenCL C allows `half` there only as a pointer target, read with the
    core builtin vload_half. Every load of a global float16 buffer becomes `vload_half(offset, data)`, float16
    local caches that GPU schedules add become float32, and the casts to float32 around them go. Kernels that
    would still hold a float16 value, or store into a float16 buffer, are refused by name. Run after the
    schedule step (it adds the local caches); build its output inside `opencl_half_pointers`, which drops the
    extension that TVM's codegen requires of any kernel naming `half`."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = mod.clone()  # the input module may still be seen by others (after_step inspection)
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and any(_is_half(p.ty.dtype.dtype) for p in func.params
                                                        if tirx.is_buffer_var(p)):
                mod[gv] = _rewrite(gv.name_hint, func)
        return mod


def _rewrite(name: str, func: tirx.PrimFunc) -> tirx.PrimFunc:
    float_locals: dict = {}

    def local_buffer(var):
        if tirx.is_buffer_var(var) and _is_half(var.ty.dtype.dtype) and not _global_half_buffer(var):
            return float_locals.setdefault(var, var.with_dtype("float32"))
        return var

    def load(expr):  # post-order: the source is already the float32 local where there is one
        buf = expr.source
        if _global_half_buffer(buf):
            (offset,) = buf.offset_of(expr.indices)
            return tirx.call_pure_extern("float32", "vload_half", offset, tirx.buffer_data(buf))
        if tirx.is_buffer_var(buf) and buf in float_locals.values():
            return tirx.BufferLoad(buf, expr.indices)
        return expr

    def cast(expr):  # a cast to float16 now casts to float32; one to float32 of what is float32 now goes
        if _is_half(expr.ty.dtype) or str(expr.ty.dtype) == str(expr.value.ty.dtype) == "float32":
            return expr.value if str(expr.value.ty.dtype) == "float32" else tirx.Cast("float32", expr.value)
        return expr

    stored = []  # an exception raised inside structural_map aborts the process: noted, raised after

    def store(stmt):
        if _global_half_buffer(stmt.buffer):
            stored.append(stmt.buffer.name)
        return stmt

    out = tvm_ffi.structural_map(func, [(tvm.ir.Var, local_buffer), (tvm.ir.TensorLoad, load),
                                        (tirx.Cast, cast), (tirx.BufferStore, store)])
    if stored:
        raise MobilecError(f"kernel {name} writes the float16 buffer {stored[0]}, {_FIX}")
    half_values = []
    tvm_ffi.structural_walk(out.body, (tvm.ir.Expr, lambda expr: half_values.append(expr) if isinstance(
        expr.ty, tvm.ir.PrimType) and _is_half(expr.ty.dtype) else None))
    if half_values:
        raise MobilecError(f"kernel {name} computes on float16 values ({half_values[0]}), {_FIX}")
    return out


def drop_fp16_extension(source: str) -> str:
    """An OpenCL kernel's source without TVM's cl_khr_fp16 block when it uses `half` only as a pointer target
    (OpenCL C allows that without the extension, and the block's #error stops a device that lacks it)."""
    without = _FP16_EXTENSION.sub("", source, count=1)
    return source if _HALF_VALUE.search(without) else without


@contextlib.contextmanager
def opencl_half_pointers() -> Iterator[None]:
    """While building VloadHalf's output: OpenCL kernels that use `half` only as a pointer target compile without
    cl_khr_fp16. Only there: elsewhere a kernel may dereference a half pointer without naming the type."""
    previous = tvm_ffi.get_global_func(_POSTPROC_HOOK, allow_missing=True)
    tvm_ffi.register_global_func(_POSTPROC_HOOK, lambda source, _target: drop_fp16_extension(source),
                                 override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(_POSTPROC_HOOK, previous, override=True)
        else:
            tvm_ffi.remove_global_func(_POSTPROC_HOOK)
