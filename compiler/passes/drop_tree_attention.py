"""DropTreeAttention: the paged KV cache's two tree-mask attention kernels (speculative decoding's token trees, which
mobilec never builds) leave the cache's create call, as empty entries, and the module."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .replace_cpu_attention import CACHE_CREATE

# TVM's tree-mask kernels' names all hold this (batch_tree_attn, tree_attn_paged_kv[_cpu]).
TREE_ATTENTION = "tree_attn"


def tree_kernel(arg: relax.Expr) -> relax.GlobalVar | None:
    """The kernel of a create-call argument ("tirx", kernel) that is a tree-mask attention kernel; else None."""
    if isinstance(arg, relax.Tuple) and len(arg.fields) == 2 and isinstance(arg.fields[1], relax.GlobalVar) \
            and TREE_ATTENTION in arg.fields[1].name_hint:
        return arg.fields[1]
    return None


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.dropped: set[relax.GlobalVar] = set()

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_pure_packed"
                and isinstance(call.args[0], relax.ExternFunc) and call.args[0].global_symbol == CACHE_CREATE):
            return super().visit_call_(call)
        trees = [tree_kernel(arg) for arg in call.args]
        self.dropped.update(gv for gv in trees if gv is not None)
        args = [relax.Tuple([]) if gv is not None else arg for arg, gv in zip(call.args, trees)]
        return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)


@tvm.transform.module_pass(opt_level=0, name="DropTreeAttention")
class DropTreeAttention:  # pylint: disable=too-few-public-methods
    """The runtime takes an empty entry for a kernel it is never asked to run (TVM's MLA caches pass them for the
    multi-head ones); the kernels are the largest TVM adds (a quarter of a tiny model's attention code) and the only
    ones over Adreno's local memory with a float32 cache. Before any pass that reads the cache's kernels."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        mod = rewriter.builder_.get()
        return tvm.IRModule({gv: func for gv, func in mod.functions_items() if gv not in rewriter.dropped},
                            attrs=mod.attrs, global_infos=mod.global_infos)
