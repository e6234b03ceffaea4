"""FuseTransposeMatmul: rewrite Relax matmul(x, permute_dims(w)) with a 2-D w into one NT_matmul call_tir (float16
products summed in float32)."""

from __future__ import annotations

import tvm
from tvm import relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator

from .ir_walk import rewrite_relax_functions

_MATMUL = tvm.ir.Op.get("relax.matmul")
_PERMUTE_DIMS = tvm.ir.Op.get("relax.permute_dims")
_ASTYPE = tvm.ir.Op.get("relax.astype")
# relax OpPatternKind::kOutEWiseFusable: FuseOps may fuse elementwise epilogues into it.
_OUT_EWISE_FUSABLE = 4


def _nt_matmul(x: te.Tensor, w: te.Tensor, out_dtype: str) -> te.Tensor:
    """x [..., K] times w [N, K] -> [..., N]; reading w row-major avoids a transposed copy."""
    k = te.reduce_axis((0, w.shape[1]), name="k")
    return te.compute(
        (*x.shape[:-1], w.shape[0]),
        lambda *i: te.sum(x[(*i[:-1], k)].astype(out_dtype) * w[i[-1], k].astype(out_dtype), axis=k),
        name="NT_matmul",
    )


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.sums: set[relax.Var] = set()  # float32 sums of float16 products, cast to float16 for their readers

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if call.op == _ASTYPE and str(call.attrs.dtype) == "float32":
            # a float16 result cast back to float32 (the logits) reads the float32 sum, unrounded
            cast = self.lookup_binding(call.args[0]) if isinstance(call.args[0], relax.Var) else None
            if isinstance(cast, relax.Call) and cast.op == _ASTYPE and cast.args[0] in self.sums:
                return cast.args[0]
            return call
        if call.op != _MATMUL:
            return call
        arg = call.args[1]
        transposed = self.lookup_binding(arg) if isinstance(arg, relax.Var) else arg
        if not isinstance(transposed, relax.Call) or transposed.op != _PERMUTE_DIMS:
            return call
        x, w = call.args[0], transposed.args[0]
        # te needs known shapes and dtype; only a plain 2-D transpose reads as W[N, K].
        if not all(isinstance(t, relax.TensorType) and t.shape is not None for t in (x.ty, w.ty, call.ty)):
            return call
        if w.ty.ndim != 2:
            return call
        axes = transposed.attrs.axes
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return call
        out_dtype = str(call.ty.dtype)
        # float16 products summed in float32 (GPU float16 builds): FuseOps puts the cast back in the kernel.
        sum_dtype = "float32" if out_dtype == "float16" else out_dtype
        product = self.builder_.call_te(
            _nt_matmul,
            x,
            w,
            sum_dtype,
            primfunc_name_hint="NT_matmul",
            primfunc_attrs={"op_pattern": _OUT_EWISE_FUSABLE},
        )
        if sum_dtype == out_dtype:
            return product
        product = self.builder_.emit(product)
        self.sums.add(product)
        return relax.op.astype(product, out_dtype)


@tvm.transform.module_pass(opt_level=0, name="FuseTransposeMatmul")
class FuseTransposeMatmul:  # pylint: disable=too-few-public-methods
    """Replace matmul(x, permute_dims(w)) by NT_matmul(x, w) in every Relax function; run before LegalizeOps.

    A float16 matmul (GPU float16 builds) sums in float32 and is cast to float16 after, which FuseOps folds into
    the kernel: SmolLM2's android-adreno q4f16_g32 artifact on Intel's OpenCL went from +0.35% to +0.05% perplexity
    over the host artifact (1024 tokens of CPython's LICENSE); a decode GEMV reads memory, not FLOPs, either way."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        # The permute_dims bindings that fed only the rewritten matmuls are dropped as dead.
        return rewrite_relax_functions(mod, _Rewriter(mod))
