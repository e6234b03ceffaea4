"""HvxGEMV: rewrite a one-row NT_matmul of weights in the "hvx" code order into int8 activation quantization plus
the integer HVX GEMV (compiler/kernels/hvx_gemv.py), both run on the Hexagon DSP."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels import hvx_gemv
from ..quantization.hvx_blocks import BLOCK
from .integer_dot_gemv import _OPAQUE, _gemv_shape, quantized_nt_matmul
from .ir_walk import rewrite_relax_functions

# The kernels' names start with these (the C kernels' own symbols are hvx_gemv_<bits>bit...: other names).
GEMV_PREFIX = "hvx_decode_gemv_"
QUANTIZE_PREFIX = "hvx_quantize_activations_"


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod
        self.kernels: dict[tuple, relax.GlobalVar] = {}

    def _kernel(self, name: str, shape: tuple, build) -> relax.GlobalVar:
        """The kernel `build` makes, added once per name and tensor shape (the builder numbers a name's others)."""
        if (name, shape) not in self.kernels:
            self.kernels[name, shape] = self.builder_.add_func(build().with_attr("op_pattern", _OPAQUE), name)
        return self.kernels[name, shape]

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        matched = quantized_nt_matmul(self, call)
        if matched is None or matched[2]["code_order"] != "hvx":
            return call
        x, stored, layout = matched
        x_shape, y_shape = _gemv_shape(x.ty), _gemv_shape(call.ty)
        if x_shape is None or y_shape is None or any(d != 1 for d in x_shape[:-1]):
            return call  # prefill, batch_decode: the dequantize that reads the hvx order stays
        n, k, bits, mins = y_shape[-1], x_shape[-1], int(layout["bits"]), not bool(layout["symmetric"])
        zero = 0 if mins else int(layout["offset"])
        quantize = self._kernel(f"{QUANTIZE_PREFIX}k{k}", x_shape,
                                lambda: hvx_gemv.tir_quantize_activations(k, x_shape))
        name = f"{GEMV_PREFIX}{bits}bit{'_mins' if mins else ''}_z{zero}_n{n}_k{k}"
        product = self._kernel(name, y_shape, lambda: hvx_gemv.tir_kernel(n, k, bits, mins, zero, y_shape))
        pairs = -(-k // (2 * BLOCK))
        act = self.builder_.emit(relax.call_tir(quantize, [x], [
            relax.TensorType([pairs * hvx_gemv.ACT_RECORD], "uint8"), relax.TensorType([2], "float32")]))
        records, factors = (self.builder_.emit(relax.TupleGetItem(act, i)) for i in range(2))
        return relax.call_tir(product, [*stored, records, factors], call.ty)


@tvm.transform.module_pass(opt_level=0, name="HvxGEMV")
class HvxGEMV:  # pylint: disable=too-few-public-methods
    """Decode GEMVs of weights stored in the "hvx" code order (4/8-bit codes in groups of 32: GGUF Q4_0, Q4_1,
    Q8_0, our g32 schemes; the hexagon-npu target with int8 decode activations) -> activation quantize + the HVX
    GEMV. After FuseTransposeMatmul and before FuseDequantizeMatmul (which fuses the dequantizes still left:
    prefill)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_relax_functions(mod, _Rewriter(mod))
