"""FuseAddRMSNorm: rewrite s = add(a, b); y = rms_norm(s, w) into one call_tir that writes both s and y."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, s_tir, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels import hvx_norms
from .ir_walk import OPAQUE, kernel_dims, rewrite_relax_functions, tensor_dims

_ADD = tvm.ir.Op.get("relax.add")
_RMS_NORM = tvm.ir.Op.get("relax.nn.rms_norm")


def _add_rms_norm(a: te.Tensor, b: te.Tensor, weight: te.Tensor, eps: float, write_sum: bool):
    """s = a + b in the input dtype; y = s * rsqrt(mean(s^2) + eps) * weight in float32, as TOPI's rms_norm."""
    h = a.shape[-1]
    total = te.compute(a.shape, lambda *i: a(*i) + b(*i), name="residual_add") if write_sum else None
    # Without a sum output the add is recomputed inline rather than kept in a scratch buffer.
    summed = total if write_sum else (lambda *i: a(*i) + b(*i))

    def f32(*i):
        return summed(*i).astype("float32")

    k = te.reduce_axis((0, h), name="k")
    sum_sq = te.compute(a.shape[:-1], lambda *i: te.sum(f32(*i, k) * f32(*i, k), axis=k), name="sum_sq")
    norm = te.compute(
        a.shape,
        lambda *i: (tirx.rsqrt(sum_sq(*i[:-1]) / h.astype("float32") + tirx.const(eps, "float32")) * f32(*i)
                    * weight[i[-1]].astype("float32")).astype(a.dtype),
        name="rms_norm",
    )
    return [total, norm] if write_sum else norm


def _schedule(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Rows over threads; each row's add, sum of squares and scaling stay in that thread (LLVM vectorizes the
    inner loops). Done here, not by a dlight rule, because the stock cpu.Reduction compute_at()s every block
    under the last one and fails on a kernel whose first block is an output (the residual sum)."""
    sch = s_tir.Schedule(func)
    first, *rest = sch.get_child_blocks(sch.get_sblock("root"))
    *lead, _ = sch.get_loops(first)
    rows = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    # one row (decode): waking the thread pool for it costs more than the row
    if not (isinstance(sch.get(rows).extent, tirx.IntImm) and int(sch.get(rows).extent) == 1):
        sch.parallel(rows)
    for block in rest:
        sch.reverse_compute_at(block, rows)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _is_last_axis(axes, ndim: int) -> bool:
    return len(axes) == 1 and int(axes[0]) in (-1, ndim - 1)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, hvx: bool):
        super().__init__(mod)
        self.uses: dict[relax.Var, int] = {}
        self.kernels: set[tvm.ir.GlobalVar] = set()  # the TE ones, scheduled afterwards
        self.hvx = hvx

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        fused = self._match(value) if isinstance(value, relax.Call) else None
        if fused is None:
            super().visit_var_binding_(binding)
            return
        add_var, a, b = fused
        # The sum feeds the next residual add too; write it only where something else reads it.
        write_sum = self.uses.get(add_var, 0) > 1
        args = [self.visit_expr(a), self.visit_expr(b), self.visit_expr(value.args[1])]
        shape = tensor_dims(value.ty)
        if self.hvx and shape is not None and value.ty.dtype == "float32":
            kernel = self.builder_.add_func(hvx_norms.tir_add_rms_norm(
                kernel_dims(shape), float(value.attrs.epsilon), write_sum).with_attr("op_pattern", OPAQUE),
                "hvx_add_rms_norm_kernel")
            call = relax.call_tir(kernel, args, [value.ty] * 2 if write_sum else value.ty)
        else:
            call = self.builder_.call_te(_add_rms_norm, *args, float(value.attrs.epsilon), write_sum,
                                         primfunc_name_hint="add_rms_norm", primfunc_attrs={"op_pattern": OPAQUE})
            self.kernels.add(call.args[0])
        if write_sum:
            both = self.builder_.emit(call, "add_rms_norm")
            # The add binding was already emitted unchanged; later readers take the kernel's sum instead.
            self.set_var_remap(add_var, self.builder_.emit(relax.TupleGetItem(both, 0), add_var.name))
            call = relax.TupleGetItem(both, 1)
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(call, binding.var.name))

    def _match(self, call: relax.Call):
        # A sum that leaves the dataflow block (an output var) keeps its own add.
        if call.op != _RMS_NORM or not isinstance(call.args[0], relax.DataflowVar):
            return None
        add = self.lookup_binding(call.args[0])
        if not isinstance(add, relax.Call) or add.op != _ADD:
            return None
        a, b = add.args
        same = all(
            isinstance(x.ty, relax.TensorType) and x.ty.shape is not None
            and tvm_ffi.structural_equal(x.ty.shape, call.ty.shape) and x.ty.dtype == call.ty.dtype
            for x in (a, b)
        )
        if not same or not _is_last_axis(call.attrs.axes, call.ty.ndim) or call.args[1].ty.ndim != 1:
            return None
        return call.args[0], a, b


@tvm.transform.module_pass(opt_level=0, name="FuseAddRMSNorm")
class FuseAddRMSNorm:  # pylint: disable=too-few-public-methods
    """Fuse the residual add into the following RMSNorm (last axis, no broadcasting); run before LegalizeOps.
    `hvx` (BuildPlan.hvx_norms): float32 ones call the HVX C kernel (kernels/hvx_norms.py) instead."""

    def __init__(self, hvx: bool = False):
        self.hvx = hvx

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _Rewriter(mod, self.hvx)
        # The add bindings whose every reader moved to the fused kernel are dropped as dead.
        mod = rewrite_relax_functions(mod, rewriter, track_uses=True)
        for gv in rewriter.kernels:
            mod[gv] = _schedule(mod[gv])
        return mod
