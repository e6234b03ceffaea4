"""IntegerDotGEMV: rewrite a one-row NT_matmul of dequantized 4/8-bit weights (or one of batch_decode's, a row per
sequence; where asked, prefill's too) into activation quantization plus an integer dot-product GEMV
(compiler/kernels/integer_dot_gemv)."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels.integer_dot_gemv import (
    ACTIVATION_BITS,
    BATCH,
    KERNEL_PREFIX,
    GemvShape,
    gemv,
    is_batch,
    quantize_activation,
)
from ..quantization.modules import LAYOUT_ATTR
from .ir_walk import OPAQUE, rewrite_relax_functions

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _gemv_shape(ty, prefill: bool) -> tuple[int | str, ...] | None:
    """The dimensions of a tensor type, BATCH for batch_decode's symbolic row count (and, with `prefill`, for any
    symbolic one: prefill's sequence length); None where another dimension is not a constant."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = ty.shape.values if hasattr(ty.shape, "values") else ty.shape
    shape = tuple(BATCH if is_batch(d) or (prefill and isinstance(d, tvm.tirx.Var)) else d for d in dims)
    if not all(isinstance(d, (str, tvm.tirx.IntImm)) for d in shape):
        return None
    return tuple(d if isinstance(d, str) else int(d) for d in shape)


def quantized_nt_matmul(rewriter: PyExprMutator, call: relax.Call):
    """(x, the stored weight arrays, the dequantize's layout attribute) when `call` is a float32
    NT_matmul(x, dequantize(...)) whose dequantize carries its layout, else None. `rewriter` has `mod`."""
    if call.op != _CALL_TIR or not call.args[0].name_hint.startswith("NT_matmul"):
        return None
    x, w = call.args[1].fields
    producer = rewriter.lookup_binding(w) if isinstance(w, relax.Var) else None
    if not isinstance(producer, relax.Call) or producer.op != _CALL_TIR:
        return None
    callee = rewriter.mod[producer.args[0]]
    layout = callee.attrs.get(LAYOUT_ATTR) if callee.attrs is not None else None
    if layout is None or x.ty.dtype != "float32" or call.ty.dtype != "float32":
        return None
    return x, list(producer.args[1].fields), layout


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, act_bits: int, dot_family: str, prefill: bool):
        super().__init__(mod)
        self.mod, self.act_bits, self.dot_family, self.prefill = mod, act_bits, dot_family, prefill
        self.kernels: dict[str, relax.GlobalVar] = {}

    def _kernel(self, name: str, build) -> relax.GlobalVar:
        if name not in self.kernels:
            func = build().with_attr("op_pattern", OPAQUE)
            self.kernels[name] = self.builder_.add_func(func, name)
        return self.kernels[name]

    def _match(self, call: relax.Call):
        """(x, stored weight arrays, GemvShape, x's and y's shapes) when `call` is NT_matmul(one-row x, or BATCH rows,
        dequantize(...)), else None."""
        matched = quantized_nt_matmul(self, call)
        if matched is None:
            return None
        x, stored, layout = matched
        x_shape, y_shape = _gemv_shape(x.ty, self.prefill), _gemv_shape(call.ty, self.prefill)
        if (x_shape is None or y_shape is None or any(d not in (1, BATCH) for d in x_shape[:-1])
                or x_shape.count(BATCH) > 1):
            return None
        shape = GemvShape(n=y_shape[-1], k=x_shape[-1], bits=int(layout["bits"]), group=int(layout["group"]),
                          symmetric=bool(layout["symmetric"]), scale_dtype=str(stored[1].ty.dtype),
                          act_bits=self.act_bits, family=self.dot_family, zero_code=int(layout["offset"]),
                          code_order=str(layout["code_order"]))
        if not shape.supported():
            return None
        return x, stored, shape, x_shape, y_shape

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        matched = self._match(call)
        if matched is None:
            return call
        x, stored, shape, x_shape, y_shape = matched
        rows = [x.ty.shape.values[i] for i, d in enumerate(x_shape) if d == BATCH]  # the activation rows, if batched
        # prefill's rows (any count, up to the context window) are quantized in parallel; batch_decode's few on the
        # calling thread, as one row's are. Both take the same GEMV.
        many_rows = bool(rows) and not is_batch(rows[0])
        batched = "_batch" if rows else ""
        quantize = self._kernel(f"quantize_activation_{shape.activation_name()}{batched}{'_parallel' * many_rows}",
                                lambda: quantize_activation(shape, x_shape, many_rows))
        product = self._kernel(f"{KERNEL_PREFIX}{shape.name()}{batched}", lambda: gemv(shape, y_shape))
        act = self.builder_.emit(relax.call_tir(quantize, [x], [
            relax.TensorType([*rows, shape.k], shape.act_dtype), relax.TensorType([*rows, shape.lane_terms], "float32"),
            relax.TensorType([*rows, shape.sum_terms], "float32")]))
        parts = [self.builder_.emit(relax.TupleGetItem(act, i)) for i in range(3)]
        return relax.call_tir(product, [*parts, *stored], call.ty)


@tvm.transform.module_pass(opt_level=0, name="IntegerDotGEMV")
class IntegerDotGEMV:  # pylint: disable=too-few-public-methods
    """Decode GEMVs of 4/8-bit group codes -> activation quantize + integer-dot GEMV: int16 (or int8) activations
    times the codes in integer arithmetic, with the instructions of `dot_family` (compiler/target/isa.py; the pipeline
    adds this step for CPUs that have one). With `prefill`, prefill's matmuls too, each row as a decode row (x86 with
    int8 activations: no integer GEMM variant, build_plan.py). After FuseTransposeMatmul and before
    FuseDequantizeMatmul (which fuses the dequantizes still left: prefill, shapes no variant takes)."""

    def __init__(self, act_bits: int, dot_family: str, prefill: bool = False):
        if act_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation bits must be one of {ACTIVATION_BITS}, got {act_bits}")
        self.act_bits, self.dot_family, self.prefill = act_bits, dot_family, prefill

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_relax_functions(mod, _Rewriter(mod, self.act_bits, self.dot_family, self.prefill))
