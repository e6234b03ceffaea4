"""ReuseHostScalars: a host function without arguments (TVM's ComputePrimValue makes one per float argument, the
attention scale of every layer's cache call) is called once per Relax function, its value reused."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .ir_walk import relax_nodes


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod
        self.first: dict[str, relax.Var] = {}  # host function -> the variable its first call is bound to

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar) and not value.args
                and isinstance(self.mod[value.op], tirx.PrimFunc)
                and self.mod[value.op].attrs.get("tirx.is_host_func")):
            name = value.op.name_hint
            if name not in self.first:
                self.first[name] = self.builder_.emit(value, binding.var.name)
            self.set_var_remap(binding.var, self.first[name])
            return
        super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="ReuseHostScalars")
class ReuseHostScalars:  # pylint: disable=too-few-public-methods
    """After memory planning and the VM's shape lowering (plan-memory-and-lower), which add the host functions."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and not _branches(func):  # a branch's variables stay in it
                rewriter.first = {}  # a function's variables are its own
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()


def _branches(func: relax.Function) -> bool:
    return bool(relax_nodes(func, relax.If))
