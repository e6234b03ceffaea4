"""FuseNormPairs: on GPUs, a norm kernel that alone reads another norm kernel's result runs it first, as one kernel."""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .chain_kernels import Chain, chained_func, kernel_call
from .fuse_gemm_norms import flattened
from .fuse_gemv_norms import reduces
from .ir_walk import AskedOnce, UniqueKernels, emit_fused_binding, packed_weights, rewrite_relax_functions, use_counts


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, schedulable: Callable[[tvm.tirx.PrimFunc], bool]):
        super().__init__(mod)
        self.mod = mod
        self.schedulable = AskedOnce(schedulable)
        # var of a pair's second binding -> (kernel name, fused PrimFunc, its Relax inputs, None: no second result)
        self.fused: dict = {}
        self.dropped: set = set()  # vars of the pairs' first bindings, now inside their kernels
        self.kernels = UniqueKernels(self.builder_)

    def plan(self, func: relax.Function) -> None:
        self.fused, self.dropped = {}, set()
        weights, uses = packed_weights(func), use_counts(func)
        for block in func.body.blocks:
            norms = {b.var: b for b in block.bindings if kernel_call(b) is not None
                     and isinstance(b.value.ty, relax.TensorType) and reduces(self.mod[b.value.args[0]])
                     and not any(isinstance(a, relax.Var) and a in weights for a in b.value.args[1].fields)}
            for second in norms.values():
                first = next((norms[a] for a in second.value.args[1].fields if a in norms
                              and isinstance(a, relax.DataflowVar) and uses.get(a) == 1), None)
                if first is None or first.var in self.fused or second.var in self.dropped:
                    continue
                built = chained_func(self.mod, Chain([first, second]), {}, {(second.var, 0)})
                if built is None:
                    continue
                fused, inputs, _ = built
                fused = flattened(fused).with_attrs(dict(self.mod[second.value.args[0]].attrs))
                if self.schedulable(fused):
                    name = f"{second.value.args[0].name_hint}_after_{first.value.args[0].name_hint}"
                    self.fused[second.var] = (name, fused, inputs, None)
                    self.dropped.add(first.var)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if not emit_fused_binding(self, binding):
            super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="FuseNormPairs")
class FuseNormPairs:  # pylint: disable=too-few-public-methods
    """Run each norm kernel (a reduction reading no projection weight) whose input is another norm kernel's result,
    read by nothing else, as one kernel with that one first (compiler/passes/fuse_norm_pairs.py): Gemma 3's last
    post-feedforward norm with its residual add before the model's final norm, which no GEMM reads and so
    FuseGEMMNorms leaves; after FuseGEMMNorms, before the schedule. `schedulable` says whether the schedule rules
    take the pair's kernel: where they do not, the kernels stay apart."""

    def __init__(self, schedulable: Callable[[tvm.tirx.PrimFunc], bool]):
        self.schedulable = schedulable

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewritten = rewrite_relax_functions(mod, _Rewriter(mod, self.schedulable), plan=True)
        return relax.transform.DeadCodeElimination()(rewritten)  # the first kernels, now inside the second
