"""IntegerDotGEMM: rewrite a many-row (prefill) NT_matmul of dequantized 4/8-bit weights into int8 row quantization
plus an integer matrix-multiply GEMM (compiler/kernels/integer_dot_gemm: smmla with i8mm, sdot with dotprod)."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels.integer_dot_gemm import TILE_M, GemmShape, gemm, quantize_rows
from .integer_dot_gemv import quantized_nt_matmul
from .ir_walk import OPAQUE, rewrite_relax_functions


def _dims(ty) -> list | None:
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    return list(ty.shape.values if hasattr(ty.shape, "values") else ty.shape)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, dot_family: str):
        super().__init__(mod)
        self.mod, self.dot_family = mod, dot_family
        self.kernels: dict[str, relax.GlobalVar] = {}

    def _kernel(self, name: str, build) -> relax.GlobalVar:
        if name not in self.kernels:
            self.kernels[name] = self.builder_.add_func(build().with_attr("op_pattern", OPAQUE), name)
        return self.kernels[name]

    def _match(self, call: relax.Call):
        """(x, stored weight arrays, GemmShape, rows) when `call` is NT_matmul(x [1, rows, K], dequantize(...))."""
        matched = quantized_nt_matmul(self, call)
        if matched is None:
            return None
        x, stored, layout = matched
        x_dims, y_dims = _dims(x.ty), _dims(call.ty)
        if x_dims is None or y_dims is None or len(x_dims) != 3 or len(y_dims) != 3:
            return None
        if not all(isinstance(d, tvm.tirx.IntImm) for d in (x_dims[0], x_dims[2], y_dims[2])) or int(x_dims[0]) != 1:
            return None
        shape = GemmShape(n=int(y_dims[2]), k=int(x_dims[2]), bits=int(layout["bits"]), group=int(layout["group"]),
                          symmetric=bool(layout["symmetric"]), scale_dtype=str(stored[1].ty.dtype),
                          family=self.dot_family, code_order=str(layout["code_order"]))
        return (x, stored, shape, x_dims[1]) if shape.supported() else None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        matched = self._match(call)
        if matched is None:
            return call
        x, stored, shape, rows = matched
        quantize = self._kernel(f"quantize_rows_{shape.activation_name()}", lambda: quantize_rows(shape))
        product = self._kernel(f"integer_dot_gemm_{shape.name()}", lambda: gemm(shape))
        panels = (rows + TILE_M - 1) // TILE_M
        outputs = [relax.TensorType([panels, TILE_M * shape.k], "int8"),
                   *[relax.TensorType([panels, shape.terms_per_panel], "float32")] * (2 if shape.activation_sums else 1)]
        act = self.builder_.emit(relax.call_tir(quantize, [x], outputs))
        parts = [self.builder_.emit(relax.TupleGetItem(act, i)) for i in range(len(outputs))]
        return relax.call_tir(product, [*parts, *stored], call.ty)


@tvm.transform.module_pass(opt_level=0, name="IntegerDotGEMM")
class IntegerDotGEMM:  # pylint: disable=too-few-public-methods
    """Prefill matmuls of 4/8-bit group codes -> int8 row quantize (a scale per 32 values, as the decode GEMV's int8
    activations) + an integer GEMM with the instructions of `dot_family` (aarch64 "i8mm" or "dotprod"). After
    IntegerDotGEMV (which takes the one-row matmuls) and before FuseDequantizeMatmul."""

    def __init__(self, dot_family: str):
        self.dot_family = dot_family

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_relax_functions(mod, _Rewriter(mod, self.dot_family))
