"""HvxGEMV: rewrite an NT_matmul of weights in the "hvx" code order into int8 activation quantization plus the
integer HVX GEMV (one activation row: decode) or GEMM (prefill, batch_decode; compiler/kernels/hvx_gemv.py), all
run on the Hexagon DSP."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels import hvx_gemv
from ..quantization.hvx_blocks import BLOCK, HALF
from .integer_dot_gemv import quantized_nt_matmul
from .ir_walk import OPAQUE, kernel_dims, rewrite_relax_functions, tensor_dims

# The kernels' names start with these (the C kernels' own symbols are hvx_gemv_<bits>bit...: other names).
GEMV_PREFIX = "hvx_decode_gemv_"
GEMM_PREFIX = "hvx_prefill_gemm_"
QUANTIZE_PREFIX = "hvx_quantize_activations_"


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod
        self.kernels: dict[tuple, relax.GlobalVar] = {}

    def _kernel(self, name: str, shape: tuple, build) -> relax.GlobalVar:
        """The kernel `build` makes, added once per name and tensor shape (symbolic dimensions by name; the builder
        numbers a name's others)."""
        key = (name, tuple(d if isinstance(d, int) else d.name for d in shape))
        if key not in self.kernels:
            self.kernels[key] = self.builder_.add_func(build().with_attr("op_pattern", OPAQUE), name)
        return self.kernels[key]

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        matched = quantized_nt_matmul(self, call)
        if matched is None or matched[2]["code_order"] != "hvx":
            return call
        x, stored, layout = matched
        x_shape, y_shape = tensor_dims(x.ty), tensor_dims(call.ty)
        if x_shape is None or y_shape is None:
            return call
        n, k, bits, mins = y_shape[-1], x_shape[-1], int(layout["bits"]), not bool(layout["symmetric"])
        zero = 0 if mins else int(layout["offset"])
        halves = int(layout["group"]) == HALF  # a scale per 16 values: its own records and activation records
        g16 = "_g16" if halves else ""
        one_row = all(d == 1 for d in x_shape[:-1])
        rows = "" if one_row else "_rows"
        quantize = self._kernel(f"{QUANTIZE_PREFIX}k{k}{g16}{rows}", x_shape,
                                lambda: hvx_gemv.tir_quantize_activations(k, kernel_dims(x_shape), halves))
        suffix = f"{bits}bit{'_mins' if mins else ''}{g16}_z{zero}_n{n}_k{k}"
        if one_row:
            product = self._kernel(f"{GEMV_PREFIX}{suffix}", y_shape,
                                   lambda: hvx_gemv.tir_kernel(n, k, bits, mins, zero, halves, y_shape))
        else:
            product = self._kernel(f"{GEMM_PREFIX}{suffix}", y_shape, lambda: hvx_gemv.tir_gemm_kernel(
                n, k, bits, mins, zero, halves, kernel_dims(y_shape)))
        leading = list(x.ty.shape.values)[:-1]
        pairs = -(-k // (2 * BLOCK))
        act = self.builder_.emit(relax.call_tir(quantize, [x], [
            relax.TensorType([*leading, pairs * hvx_gemv.act_record(halves)], "uint8"),
            relax.TensorType([*leading, 2], "float32")]))
        records, factors = (self.builder_.emit(relax.TupleGetItem(act, i)) for i in range(2))
        return relax.call_tir(product, [*stored, records, factors], call.ty)


@tvm.transform.module_pass(opt_level=0, name="HvxGEMV")
class HvxGEMV:  # pylint: disable=too-few-public-methods
    """NT_matmuls of weights stored in the "hvx" code order (4/8-bit codes in groups of a multiple of 32, 8-bit ones
    in groups of 16: GGUF Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, our g32 and g128 schemes; the hexagon-npu target with
    int8 decode activations) -> activation quantize + the HVX GEMV
    (one row) or GEMM (several: prefill, batch_decode). After FuseTransposeMatmul and before FuseDequantizeMatmul
    (which fuses the dequantizes still left: the embedding's)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_relax_functions(mod, _Rewriter(mod))
