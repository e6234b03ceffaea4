"""RMSNorm with the residual add and SwiGLU for a hexagon target, float32: TIR kernels that call
native/hexagon/hvx_norms.c (call_extern), which the emulated DSP's kernel server links."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from . import parse_cache
from .hvx_gemv import leading_rows


def _rows(shape: tuple) -> tirx.PrimExpr:
    return T.Cast("int32", leading_rows(shape))


@parse_cache.cached
def tir_add_rms_norm(shape: tuple, eps: float, write_sum: bool) -> tirx.PrimFunc:
    """(sum, norm) of a, b [..., n] and weight [n] (norm alone without `write_sum`): hvx_add_rms_norm; `shape`'s
    leading dimensions are ints or tirx.Var (prefill's sequence length)."""
    n, rows = shape[-1], _rows(shape)
    null = T.reinterpret("handle", T.uint64(0))

    @T.prim_func(private=True)
    def add_rms_norm_sum(a: T.Buffer(shape, "float32"), b: T.Buffer(shape, "float32"),
                         weight: T.Buffer((n,), "float32"), total: T.Buffer(shape, "float32"),
                         norm: T.Buffer(shape, "float32")):
        # both outputs come back from the DSP (codegen/hexagon.written_params)
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "mobilec.npu_writes": [3, 4]})
        T.evaluate(T.call_extern("void", "hvx_add_rms_norm", a.data, b.data, weight.data, total.data, norm.data,
                                 rows, n, T.float32(eps)))

    @T.prim_func(private=True)
    def add_rms_norm(a: T.Buffer(shape, "float32"), b: T.Buffer(shape, "float32"),
                     weight: T.Buffer((n,), "float32"), norm: T.Buffer(shape, "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        T.evaluate(T.call_extern("void", "hvx_add_rms_norm", a.data, b.data, weight.data, null, norm.data, rows, n,
                                 T.float32(eps)))

    return add_rms_norm_sum if write_sum else add_rms_norm


@parse_cache.cached
def tir_swiglu(shape: tuple) -> tirx.PrimFunc:
    """out [..., d] = silu(x[..., :d]) * x[..., d:] of x `shape` [..., 2d]: hvx_swiglu."""
    d, rows = shape[-1] // 2, _rows(shape)
    out_shape = (*shape[:-1], d)

    @T.prim_func(private=True, check_well_formed=False)  # the root block below: parsed alone it is not
    def swiglu(x: T.Buffer(shape, "float32"), out: T.Buffer(out_shape, "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        # a root block: Relax's RewriteDataflowReshape inspects every one-input kernel's body for a reshape
        with T.sblock("root"):
            T.evaluate(T.call_extern("void", "hvx_swiglu", x.data, out.data, rows, d))

    return swiglu
