"""FuseSwiGLU: rewrite g, u = split(x, 2, axis=-1); silu(g) * u as one elementwise call_tir over x, no split copies."""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels import hvx_norms
from .expand_npu_math import float_sigmoid
from .ir_walk import OPAQUE, kernel_dims, rewrite_relax_functions, tensor_dims

_SPLIT = tvm.ir.Op.get("relax.split")
_SILU = tvm.ir.Op.get("relax.nn.silu")
_MULTIPLY = tvm.ir.Op.get("relax.multiply")
# OpPatternKind::kInjective, as FuseOps treated the split it replaces: it is not fused into the matmuls around it.
_INJECTIVE = 2


def _swiglu(x: te.Tensor, arithmetic: bool) -> te.Tensor:
    """out[..., i] = silu(x[..., i]) * x[..., i + d]; silu(g) = g * sigmoid(g), TOPI's order of operations.
    `arithmetic`: the sigmoid as expand_npu_math's arithmetic, which vectorizes (LLVM's CPU code calls libm's expf
    for each lane of a vector exp: SmolLM2's down_proj prologue, SwiGLU and quantize of 1536 values, took 6.7 us
    with it and 4.4 us without, on one Zen 3 core)."""
    d = x.shape[-1] // 2

    def value(*i):
        gate = x(*i[:-1], i[-1])
        return gate * (float_sigmoid(gate) if arithmetic else tirx.sigmoid(gate)) * x(*i[:-1], i[-1] + d)

    return te.compute((*x.shape[:-1], d), value, name="swiglu")


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, hvx: bool, arithmetic_sigmoid: bool):
        super().__init__(mod)
        self.uses: dict[relax.Var, int] = {}
        self.hvx = hvx
        self.arithmetic_sigmoid = arithmetic_sigmoid

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        x = self._match(call)
        if x is None:
            return call
        shape = tensor_dims(x.ty)
        if self.hvx and shape is not None and x.ty.dtype == "float32":
            kernel = self.builder_.add_func(hvx_norms.tir_swiglu(kernel_dims(shape)).with_attr(
                "op_pattern", OPAQUE), "hvx_swiglu_kernel")
            return relax.call_tir(kernel, [x], call.ty)
        return self.builder_.call_te(_swiglu, x, self.arithmetic_sigmoid, primfunc_name_hint="swiglu",
                                     primfunc_attrs={"op_pattern": _INJECTIVE})

    def _binding(self, expr: relax.Expr, op=None):
        """The value bound to `expr` if it is a single-use dataflow var (and a call to `op`, if given)."""
        if not isinstance(expr, relax.DataflowVar) or self.uses.get(expr, 0) != 1:
            return None
        value = self.lookup_binding(expr)
        if op is not None and not (isinstance(value, relax.Call) and value.op == op):
            return None
        return value

    def _match(self, call: relax.Call):
        """x if `call` is multiply(silu(split(x)[0]), split(x)[1]), either order, and nothing else reads the parts."""
        if call.op != _MULTIPLY:
            return None
        for silu_var, up_var in (call.args, list(reversed(call.args))):
            silu = self._binding(silu_var, _SILU)
            gate = self._binding(silu.args[0]) if silu is not None else None
            up = self._binding(up_var)
            if not (isinstance(gate, relax.TupleGetItem) and isinstance(up, relax.TupleGetItem)):
                continue
            parts = gate.tuple_value
            if gate.index != 0 or up.index != 1 or not parts.same_as(up.tuple_value):
                continue
            if not isinstance(parts, relax.DataflowVar) or self.uses.get(parts, 0) != 2:
                continue
            split = self.lookup_binding(parts)
            if isinstance(split, relax.Call) and split.op == _SPLIT and self._halves_last_axis(split):
                return split.args[0]
        return None

    @staticmethod
    def _halves_last_axis(split: relax.Call) -> bool:
        sections, axis, ndim = split.attrs.indices_or_sections, int(split.attrs.axis), split.args[0].ty.ndim
        return isinstance(sections, tirx.IntImm) and int(sections) == 2 and axis in (-1, ndim - 1)


@tvm.transform.module_pass(opt_level=0, name="FuseSwiGLU")
class FuseSwiGLU:  # pylint: disable=too-few-public-methods
    """Replace the split / silu / multiply chain of a SwiGLU MLP by one kernel; run before LegalizeOps. `hvx`
    (BuildPlan.hvx_norms): float32 ones call the HVX C kernel (kernels/hvx_norms.py) instead. `arithmetic_sigmoid`
    (CPU targets): the sigmoid in arithmetic that vectorizes (_swiglu); GPUs keep their exp."""

    def __init__(self, hvx: bool = False, arithmetic_sigmoid: bool = False):
        self.hvx = hvx
        self.arithmetic_sigmoid = arithmetic_sigmoid

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        # The split, its items and the silu are dropped as dead once the multiply is replaced.
        return rewrite_relax_functions(mod, _Rewriter(mod, self.hvx, self.arithmetic_sigmoid), track_uses=True)
