"""FuseGEMVPrologue: on GPUs, the RMSNorm whose only reader is a projection's decode GEMV becomes that GEMV's prologue:
each work group reduces the row itself (a few hundred multiply-adds) instead of a launch of its own and a round trip
of the normalized row through global memory.

Only producers that reduce the row (norms) qualify: an elementwise producer (SwiGLU before the down projection) would
be recomputed by every work group for every weight it multiplies (a GPU GEMV work group holds 2-4 rows), one sigmoid
per weight, which costs a large model more than the launch it saves."""

from __future__ import annotations

from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .chain_kernels import decode_shapes, kernel_call, same_buffer
from .ir_walk import UniqueKernels, equal_entry, packed_weights, tir_statements, use_counts


def _reduces(func: tirx.PrimFunc) -> bool:
    """Whether some block of `func` has a reduction iterator."""
    return any(isinstance(stmt, s_tir.SBlock) and any(v.iter_type == tirx.IterVar.CommReduce for v in stmt.iter_vars)
               for stmt in tir_statements(func.body))


def _root(func: tirx.PrimFunc) -> s_tir.SBlock:
    return func.body.block


def _stmts(stmt) -> list:
    return list(stmt.seq) if isinstance(stmt, tirx.SeqStmt) else [stmt]


def fuse(producer: tirx.PrimFunc, consumer: tirx.PrimFunc, index: int, producer_args: list, consumer_args: list
         ) -> tuple[tirx.PrimFunc, list]:
    """One PrimFunc running `producer` then `consumer`, whose parameter `index` reads the producer's one result: that
    result becomes a buffer of the function's own; the Relax arguments read once where both kernels read them."""
    result = producer.params[-1]
    inputs = list(producer_args)
    params = list(producer.params[:-1])
    pairs = [(consumer.params[index], result)]
    for i, (arg, param) in enumerate(zip(consumer_args, consumer.params)):
        if i == index:
            continue
        known = next((j for j, seen in enumerate(inputs) if seen.same_as(arg)), None)
        if known is not None and same_buffer(param, params[known]):
            pairs.append((param, params[known]))
            continue
        inputs.append(arg)
        params.append(param)
    params.extend(consumer.params[len(consumer_args):])

    def replace(var):
        return next((new for old, new in pairs if var.same_as(old)), var)

    consumer_root = tvm_ffi.structural_map(_root(consumer), [(tvm.ir.expr.Var, replace)])
    root = s_tir.SBlock([], [], [], "root", tirx.SeqStmt(_stmts(_root(producer).body) + _stmts(consumer_root.body)),
                        alloc_buffers=[*_root(producer).alloc_buffers, result, *consumer_root.alloc_buffers])
    func = tirx.PrimFunc(params, s_tir.SBlockRealize([], True, root)).with_attrs(dict(consumer.attrs))
    return func, inputs


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, schedulable: Callable[[tirx.PrimFunc], bool]):
        super().__init__(mod)
        self.mod = mod
        self.schedulable = schedulable
        self.fused: dict = {}  # var of a GEMV binding -> (fused PrimFunc, its Relax inputs)
        self.dropped: set = set()  # vars of the producers now inside a GEMV
        self.kernels = UniqueKernels(self.builder_)
        self.verdicts: list[tuple[tirx.PrimFunc, bool]] = []  # each layer's fused kernels are the same: asked once

    def plan(self, func: relax.Function) -> None:
        self.fused, self.dropped = {}, set()
        weights, uses = packed_weights(func), use_counts(func)
        for block in func.body.blocks:
            calls = {b.var: b for b in block.bindings if kernel_call(b) is not None and decode_shapes(b.value)}
            for binding in calls.values():
                args = list(binding.value.args[1].fields)
                if not any(isinstance(a, relax.Var) and a in weights for a in args):
                    continue
                for index, arg in enumerate(args):
                    producer = calls.get(arg)
                    # a dataflow var read once: the producer's result is not needed outside the GEMV
                    if (producer is None or not isinstance(arg, relax.DataflowVar) or uses.get(arg) != 1
                            or not isinstance(producer.value.ty, relax.TensorType)
                            or not _reduces(self.mod[producer.value.args[0]])
                            or any(isinstance(a, relax.Var) and a in weights for a in producer.value.args[1].fields)):
                        continue
                    built = fuse(self.mod[producer.value.args[0]], self.mod[binding.value.args[0]], index,
                                 list(producer.value.args[1].fields), args)
                    if self._schedulable(built[0]):
                        self.fused[binding.var] = (producer.value.args[0].name_hint, *built)
                        self.dropped.add(arg)
                        break

    def _schedulable(self, func: tirx.PrimFunc) -> bool:
        verdict = equal_entry(self.verdicts, func)
        if verdict is None:
            verdict = self.schedulable(func)
            self.verdicts.append((func, verdict))
        return verdict

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.dropped:
            return
        if binding.var not in self.fused:
            super().visit_var_binding_(binding)
            return
        producer, func, inputs = self.fused[binding.var]
        gv = self.kernels.add(func, f"{binding.value.args[0].name_hint}_after_{producer}")
        call = relax.call_tir(gv, [self.visit_expr(i) for i in inputs], binding.value.ty)
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(call, binding.var.name))


@tvm.transform.module_pass(opt_level=0, name="FuseGEMVPrologue")
class FuseGEMVPrologue:  # pylint: disable=too-few-public-methods
    """Fuse the norm kernel each decode GEMV alone reads into it (compiler/passes/fuse_gemv_prologue.py); after
    FuseTIR, before the schedule. `schedulable` says whether the schedule rules take a fused kernel: where they do
    not, the two kernels stay apart."""

    def __init__(self, schedulable: Callable[[tirx.PrimFunc], bool]):
        self.schedulable = schedulable

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _Rewriter(mod, self.schedulable)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.plan(func)
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
