"""FuseGEMVNorms: on GPUs, the norms around a projection's decode GEMV run inside it, not as launches of their own.

Prologue: the RMSNorm whose only reader is the GEMV, with the dtype cast of its input if only the norm reads that
(Gemma's float32 norms of a float16 row); each work group reduces the row itself (a few hundred multiply-adds)
instead of a round trip of the normalized row through global memory. Epilogue: a norm over groups of the GEMV's
results (Qwen3's and Gemma 3's q/k norm over each head of the QKV projection), reached through kernels that only move
data (a reshape), and the kernels after it that alone read its result (Gemma's RoPE, within each head); the GEMV rule
gives such a kernel one group (head) per work group, which it normalizes before writing it.

Residual prologue: the norm kernel the prologue's norm (or its cast) reads (Gemma 3's post-attention and
post-feedforward norms with their residual adds: the row the next norm reduces is residual + norm(projection)). It
cannot be the epilogue of the projection it normalizes (O, down): that norm needs the whole output row and a work
group holds a few rows. So each work group of the next GEMV (gate/up; the next layer's QKV; lm_head) computes it
too: two row reductions instead of one, a few thousand multiply-adds against the rows of weights it multiplies, and
no launch: Gemma 3 gets Llama's 6 launches per layer on GPUs (QKV, attention, O, gate/up, GeGLU, down).
Where others read its result as well (the residual stream, read by the next residual add after the GEMV), the
kernel runs that norm kernel a second time, last, into a second result, and the schedule runs the second run in the
first work group only: every work group reads the row it computed itself, never the result, so no work group reads
what another writes, and each value is written once (Oclgrind: no race). A second run, not a copy of the first: the
first run's row reduction moves into the GEMV's work group loop by compute_at, which TVM allows only once every
reader is inside, and a copy (a result block) gets inside only by reverse_compute_at, once what it reads is inside.
Where the residual row is also read before the GEMV (or its epilogue) ends, the norm kernel stays a kernel.

Only norms (kernels that reduce) qualify: an elementwise producer (SwiGLU before the down projection) would be
recomputed by every work group for every weight it multiplies (a GPU GEMV work group holds 2-4 rows), one sigmoid
per weight, which costs a large model more than the launch it saves."""

from __future__ import annotations

from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .chain_kernels import decode_shapes, kernel_call, same_buffer
from .ir_walk import (AskedOnce, UniqueKernels, emit_fused_binding, is_reduction, packed_weights,
                      rewrite_relax_functions, stmts_of, tir_statements, use_counts)


def reduces(func: tirx.PrimFunc) -> bool:
    """Whether some block of `func` has a reduction iterator."""
    return any(isinstance(stmt, s_tir.SBlock) and is_reduction(stmt) for stmt in tir_statements(func.body))


def moves_data(func: tirx.PrimFunc) -> bool:
    """Whether every block of `func` stores a value it loads, at most converted (a reshape, a dtype cast)."""
    blocks = [stmt for stmt in tir_statements(func.body) if isinstance(stmt, s_tir.SBlock) and stmt.name_hint != "root"]

    def loaded(value) -> bool:
        return isinstance(value, tvm.ir.expr.TensorLoad) or (isinstance(value, tirx.Cast) and loaded(value.value))

    return bool(blocks) and all(isinstance(b.body, tirx.BufferStore) and loaded(b.body.value) for b in blocks)


def _root(func: tirx.PrimFunc) -> s_tir.SBlock:
    return func.body.block


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
    root = s_tir.SBlock([], [], [], "root", tirx.SeqStmt(stmts_of(_root(producer).body) + stmts_of(consumer_root.body)),
                        alloc_buffers=[*_root(producer).alloc_buffers, result, *consumer_root.alloc_buffers])
    func = tirx.PrimFunc(params, s_tir.SBlockRealize([], True, root)).with_attrs(dict(consumer.attrs))
    return func, inputs


def with_second_run(func: tirx.PrimFunc, inputs: list, producer: tirx.PrimFunc, producer_args: list
                    ) -> tirx.PrimFunc:
    """`func` (whose Relax inputs are `inputs`, among them every one of `producer_args`) that also runs `producer`
    (a copy with variables of its own) last, into a result of its own before its last."""
    copy = tvm.ir.load_json(tvm.ir.save_json(producer))
    pairs = [(param, func.params[next(i for i, known in enumerate(inputs) if known.same_as(arg))])
             for arg, param in zip(producer_args, copy.params)]

    def replace(var):
        return next((new for old, new in pairs if var.same_as(old)), var)

    copy_root = tvm_ffi.structural_map(_root(copy), [(tvm.ir.expr.Var, replace)])
    root = s_tir.SBlock([], [], [], "root", tirx.SeqStmt(stmts_of(_root(func).body) + stmts_of(copy_root.body)),
                        alloc_buffers=[*_root(func).alloc_buffers, *copy_root.alloc_buffers])
    params = [*func.params[:-1], copy.params[-1], func.params[-1]]
    return tirx.PrimFunc(params, s_tir.SBlockRealize([], True, root)).with_attrs(dict(func.attrs))


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, schedulable: Callable[[tirx.PrimFunc], bool]):
        super().__init__(mod)
        self.mod = mod
        self.schedulable = AskedOnce(schedulable)  # each layer's fused kernels are the same: asked once
        # var of a group's last binding -> (kernel name, fused PrimFunc, its Relax inputs, the var of the residual
        # prologue's result where the kernel writes it too, else None)
        self.fused: dict = {}
        self.dropped: set = set()  # vars of the other bindings of a group, now inside its kernel
        self.order: dict = {}  # var -> the position of its binding in its block
        self.kernels = UniqueKernels(self.builder_)

    def plan(self, func: relax.Function) -> None:
        self.fused, self.dropped = {}, set()
        weights, uses = packed_weights(func), use_counts(func)
        for block in func.body.blocks:
            calls = {b.var: b for b in block.bindings if kernel_call(b) is not None and decode_shapes(b.value)}
            self.order = {b.var: i for i, b in enumerate(block.bindings)}
            read_at: dict = {}  # var -> the positions of the bindings that read it
            for i, binding in enumerate(block.bindings):
                for var in relax.analysis.free_vars(binding.value):
                    read_at.setdefault(var, []).append(i)
            readers: dict = {}  # var -> the kernel bindings that read it
            for binding in calls.values():
                for arg in binding.value.args[1].fields:
                    readers.setdefault(arg, []).append(binding)

            def reads_weight(binding) -> bool:
                return any(isinstance(a, relax.Var) and a in weights for a in binding.value.args[1].fields)

            def only_reader(var):
                """The kernel binding that alone reads dataflow var `var` (its value needed nowhere else)."""
                found = readers.get(var, [])
                if isinstance(var, relax.DataflowVar) and uses.get(var) == 1 and len(found) == 1:
                    return found[0]
                return None

            def is_norm(binding) -> bool:
                return (isinstance(binding.value.ty, relax.TensorType) and not reads_weight(binding)
                        and reduces(self.mod[binding.value.args[0]]))

            for gemv in filter(reads_weight, calls.values()):
                prologue = next(((calls[a], i) for i, a in enumerate(gemv.value.args[1].fields)
                                 if a in calls and only_reader(a) is gemv and is_norm(calls[a])), None)
                if prologue is not None:  # the cast of the norm's input, if only the norm reads it
                    norm = prologue[0]
                    cast = next(((calls[a], j) for j, a in enumerate(norm.value.args[1].fields)
                                 if a in calls and only_reader(a) is norm and not reads_weight(calls[a])
                                 and isinstance(calls[a].value.ty, relax.TensorType)
                                 and moves_data(self.mod[calls[a].value.args[0]])), None)
                    # the norm kernel the first of them reads (a post-norm with its residual add), and the
                    # positions of the other readers of its result
                    first = norm if cast is None else cast[0]
                    residual = next(((calls[a], j, [i for i in read_at[a] if i != self.order[first.var]])
                                     for j, a in enumerate(first.value.args[1].fields)
                                     if a in calls and isinstance(a, relax.DataflowVar) and is_norm(calls[a])), None)
                    prologue = (*prologue, cast, residual)
                # kernels that move data, the norm, then kernels that only compute on its result (Gemma's RoPE)
                epilogue, var, norm = [], gemv.var, None
                while (reader := only_reader(var)) is not None and not reads_weight(reader):
                    if reduces(self.mod[reader.value.args[0]]):
                        if norm is not None or not is_norm(reader):
                            break
                        norm = len(epilogue)
                    elif norm is None and not moves_data(self.mod[reader.value.args[0]]):
                        break
                    epilogue.append(reader)
                    var = reader.var
                # each with the longest epilogue the schedule takes
                tails = [epilogue[:end] for end in range(len(epilogue), norm, -1)] if norm is not None else []
                # the residual prologue, if any, first
                prologues = [] if prologue is None else [prologue] + ([(*prologue[:3], None)] if prologue[3] else [])
                for group in [*([p, tail] for p in prologues for tail in [*tails, []]),
                              *([None, tail] for tail in tails)]:
                    if self._try(gemv, *group):
                        break

    def _try(self, gemv: relax.VarBinding, prologue: tuple | None, epilogue: list) -> bool:
        """Fuse `prologue` (a norm binding, the GEMV argument it computes, (the binding of a cast, the norm
        argument it computes) or None, and (the binding of a residual prologue, the argument of the cast or else the
        norm it computes, the positions of its result's other readers) or None), `gemv` and `epilogue` (the bindings
        after it, each reading the one before) into one kernel, if there is more than the GEMV, the residual
        prologue's result is read elsewhere only after the kernel, and the schedule takes it."""
        norm, index, cast, residual = prologue if prologue is not None else (None, None, None, None)
        before = [part[0] for part in (prologue, cast, residual) if part is not None]
        bindings = [gemv, *epilogue, *before]
        if (prologue is None and not epilogue) or any(b.var in self.fused or b.var in self.dropped for b in bindings):
            return False
        last = (epilogue or [gemv])[-1]
        if residual is not None and any(i <= self.order[last.var] for i in residual[2]):
            return False
        func, inputs = self.mod[gemv.value.args[0]], list(gemv.value.args[1].fields)
        name = gemv.value.args[0].name_hint
        if prologue is not None:
            # (binding, the argument of the next kernel it computes) in running order, each fused into the next
            (head, at), *chain = [part[:2] for part in (residual, cast, (norm, index)) if part is not None]
            before_func, before_inputs = self.mod[head.value.args[0]], list(head.value.args[1].fields)
            for binding, next_at in chain:
                before_func, before_inputs = fuse(before_func, self.mod[binding.value.args[0]], at, before_inputs,
                                                  list(binding.value.args[1].fields))
                at = next_at
            func, inputs = fuse(before_func, func, at, before_inputs, inputs)
            name = f"{name}_after_{norm.value.args[0].name_hint}"
            if residual is not None:
                name = f"{name}_after_{residual[0].value.args[0].name_hint}"
        previous = gemv
        for binding in epilogue:
            args = list(binding.value.args[1].fields)
            func, inputs = fuse(func, self.mod[binding.value.args[0]], args.index(previous.var), inputs, args)
            previous = binding
        if epilogue:
            norm = next(b.value.args[0] for b in epilogue if reduces(self.mod[b.value.args[0]]))
            name = f"{name}_then_{norm.name_hint}"
        second_result = residual[0].var if residual is not None and residual[2] else None
        if second_result is not None:
            func = with_second_run(func, inputs, self.mod[residual[0].value.args[0]],
                                   list(residual[0].value.args[1].fields))
        func = tirx.PrimFunc(func.params, func.body).with_attrs(dict(self.mod[gemv.value.args[0]].attrs))
        if not self.schedulable(func):
            return False
        self.fused[previous.var] = (name, func, inputs, second_result)
        self.dropped.update(b.var for b in [gemv, *epilogue[:-1], *before] if b is not previous)
        return True

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if not emit_fused_binding(self, binding):
            super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="FuseGEMVNorms")
class FuseGEMVNorms:  # pylint: disable=too-few-public-methods
    """Fuse into each decode GEMV the norm kernel it alone reads (with its input's cast, and the norm kernel that reads,
    with a second result where others read that one's) and the norm over groups of its results that alone reads them
    (with what alone reads the norm's result), compiler/passes/fuse_gemv_norms.py; after FuseTIR, before the schedule.
    `schedulable` says whether the schedule rules take a fused kernel: where they do not, the kernels stay apart (a
    shorter epilogue is tried first, then the prologue without the residual norm kernel)."""

    def __init__(self, schedulable: Callable[[tirx.PrimFunc], bool]):
        self.schedulable = schedulable

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewritten = rewrite_relax_functions(mod, _Rewriter(mod, self.schedulable), plan=True)
        return relax.transform.DeadCodeElimination()(rewritten)  # the kernels now inside others
