"""Small IR walks shared by several passes and checks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

_CHILDREN = ("body", "seq", "block", "then_case", "else_case", "init")
# relax OpPatternKind::kOpaque: FuseOps leaves a kernel with this pattern alone (hand-written and two-output kernels)
OPAQUE = 8


def tir_statements(node) -> Iterator:
    """Pre-order walk over a (flat, 0.27-style) TIR statement tree."""
    if node is None:
        return
    if isinstance(node, (list, tvm.ir.Array)) or type(node).__name__ == "Array":
        for item in node:
            yield from tir_statements(item)
        return
    yield node
    for field in _CHILDREN:
        if hasattr(node, field):
            yield from tir_statements(getattr(node, field))


def relax_nodes(expr, node_type: type = relax.Call) -> list:
    """Every Relax call (or If: `node_type`) in `expr`, a function or any expression, in the order
    relax.analysis.post_order_visit meets them, found by walking where the normal form holds them (binding values,
    an If's branches, a call's arguments) instead of calling back into Python at every node: on SmolLM2's lowered
    functions ~0.1 s a walk instead of ~0.8 s, and the last steps of every compile walk them several times."""
    found: list = []

    def walk(node) -> None:
        if isinstance(node, relax.Call):
            for part in (node.op, *node.args):
                walk(part)
        elif isinstance(node, relax.SeqExpr):
            for block in node.blocks:
                for binding in block.bindings:
                    walk(binding.value)
            walk(node.body)
        elif isinstance(node, relax.If):
            for part in (node.cond, node.true_branch, node.false_branch):
                walk(part)
        elif isinstance(node, relax.Tuple):
            for field in node.fields:
                walk(field)
        elif isinstance(node, relax.TupleGetItem):
            walk(node.tuple_value)
        elif isinstance(node, relax.Function):
            walk(node.body)
        if isinstance(node, node_type):
            found.append(node)

    walk(expr)
    return found


def is_reduction(block: s_tir.SBlock) -> bool:
    """Whether `block` has a reduction iterator."""
    return any(v.iter_type == tirx.IterVar.CommReduce for v in block.iter_vars)


def stmts_of(stmt) -> list:
    """The statements of a sequence, or the one statement."""
    return list(stmt.seq) if isinstance(stmt, tirx.SeqStmt) else [stmt]


def use_counts(func: relax.Function) -> dict[relax.Var, int]:
    """How many bindings read each dataflow variable (a fusion may only absorb a value nothing else reads)."""
    counts: dict[relax.Var, int] = {}
    for block in func.body.blocks:
        if isinstance(block, relax.DataflowBlock):
            for var, users in relax.analysis.udchain(block).items():
                counts[var] = counts.get(var, 0) + len(users)
    return counts


def packed_weights(func: relax.Function) -> set:
    """The variables bound to items of the function's parameter tuple (the packed weights) of 2+ dimensions: the
    projections' and the embedding's, not the norms' vectors."""
    params = {p for p in func.params if isinstance(p.ty, relax.TupleType)}
    return {b.var for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.TupleGetItem) and any(b.value.tuple_value.same_as(p) for p in params)
            and isinstance(b.var.ty, relax.TensorType) and b.var.ty.ndim >= 2}


def rewrite_relax_functions(mod: tvm.IRModule, rewriter, track_uses: bool = False, plan: bool = False
                            ) -> tvm.IRModule:
    """Run `rewriter` (a PyExprMutator built over `mod`) on every Relax function and drop the bindings the
    rewrite left unread. With `track_uses`, `rewriter.uses` holds each function's use counts while it runs; with
    `plan`, `rewriter.plan(func)` decides each function's rewrite before it runs."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            if track_uses:
                rewriter.uses = use_counts(func)
            if plan:
                rewriter.plan(func)
            rewriter.builder_.update_func(gv, relax.analysis.remove_all_unused(rewriter.visit_expr(func)))
    return rewriter.builder_.get()


def equal_entry(entries: list[tuple[tirx.PrimFunc, Any]], func: tirx.PrimFunc) -> Any:
    """The value beside the first PrimFunc of `entries` structurally equal to `func` (free variables mapped); None
    when there is none."""
    return next((value for known, value in entries if tvm_ffi.structural_equal(known, func, map_free_vars=True)), None)


class AskedOnce:  # pylint: disable=too-few-public-methods
    """`ask(func)` once per kernel: a PrimFunc structurally equal to one asked about before (another layer's) gets that
    one's answer."""

    def __init__(self, ask: Callable[[tirx.PrimFunc], Any]):
        self.ask = ask
        self.answers: list[tuple[tirx.PrimFunc, Any]] = []

    def __call__(self, func: tirx.PrimFunc) -> Any:
        answer = equal_entry(self.answers, func)
        if answer is None:
            answer = self.ask(func)
            self.answers.append((func, answer))
        return answer


class UniqueKernels:  # pylint: disable=too-few-public-methods
    """The PrimFuncs a rewrite adds to its module, each once: a kernel structurally equal to one added before (another
    layer's) reuses that one's GlobalVar."""

    def __init__(self, builder: relax.BlockBuilder):
        self.builder = builder
        self.added: list[tuple[tirx.PrimFunc, relax.GlobalVar]] = []

    def add(self, func: tirx.PrimFunc, name: str) -> relax.GlobalVar:
        gv = equal_entry(self.added, func)
        if gv is not None:
            return gv
        gv = self.builder.add_func(func, name)
        self.added.append((func, gv))
        return gv


def emit_fused_binding(rewriter, binding: relax.VarBinding) -> bool:
    """For a fusing rewriter (FuseGEMVNorms, FuseGEMMNorms: `fused` var -> (kernel name, PrimFunc, inputs, the var of
    its second result or None), `dropped` vars, `kernels` UniqueKernels): emit nothing for a dropped binding, the
    fused kernel's call (and its second result) for a fused one, and say whether the binding was either."""
    if binding.var in rewriter.dropped:
        return True
    if binding.var not in rewriter.fused:
        return False
    name, func, inputs, second_result = rewriter.fused[binding.var]
    gv = rewriter.kernels.add(func, name)
    args = [rewriter.visit_expr(i) for i in inputs]
    builder = rewriter.builder_
    emit = builder.emit if isinstance(binding.var, relax.DataflowVar) else builder.emit_output
    if second_result is None:
        rewriter.set_var_remap(binding.var, emit(relax.call_tir(gv, args, binding.value.ty), binding.var.name))
        return True
    results = builder.emit(relax.call_tir(gv, args, [second_result.ty, binding.value.ty]), binding.var.name)
    rewriter.set_var_remap(second_result, builder.emit(relax.TupleGetItem(results, 0), second_result.name))
    rewriter.set_var_remap(binding.var, emit(relax.TupleGetItem(results, 1), binding.var.name))
    return True


def tensor_dims(ty) -> tuple | None:
    """A tensor type's dimensions: ints, and tirx.Var for symbolic ones (prefill's sequence length, batch_decode's
    rows); None for other shapes."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = tuple(ty.shape.values if hasattr(ty.shape, "values") else ty.shape)
    if not all(isinstance(d, (tirx.IntImm, tirx.Var)) for d in dims):
        return None
    return tuple(int(d) if isinstance(d, tirx.IntImm) else d for d in dims)


def kernel_dims(dims: tuple) -> tuple:
    """`dims` with a new TIR variable, of the same name, for each symbolic dimension (a kernel's own)."""
    return tuple(d if isinstance(d, int) else tirx.Var(d.name, "int64") for d in dims)
