"""FuseGEMMNorms: on GPUs, the norms around a prefill GEMM (RMSNorm, post-norm; q/k norm, RoPE) run inside it."""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, s_tir, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .chain_kernels import Chain, chained_func, decode_shapes, kernel_call
from .fuse_gemv_norms import moves_data, reduces, with_second_run
from .ir_walk import (AskedOnce, UniqueKernels, emit_fused_binding, packed_weights, rewrite_relax_functions, stmts_of,
                      use_counts)


def flattened(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` (a chain of kernels, each its root block) with one root block: the kernels' statements and buffers in
    it, as the schedule rules expect a fused kernel."""
    root = func.body.block
    stmts, allocs = [], list(root.alloc_buffers)
    for part in stmts_of(root.body):
        stmts.extend(stmts_of(part.block.body))
        allocs.extend(part.block.alloc_buffers)
    return tirx.PrimFunc(func.params, s_tir.SBlockRealize([], True, s_tir.SBlock(
        [], [], [], "root", tirx.SeqStmt(stmts), alloc_buffers=allocs)))


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, schedulable: Callable[[tirx.PrimFunc], bool]):
        super().__init__(mod)
        self.mod = mod
        self.schedulable = AskedOnce(schedulable)  # each layer's fused kernels are the same: asked once
        # var of a group's last binding -> (kernel name, fused PrimFunc, its Relax inputs, the var of the residual
        # prologue's result where the kernel writes it too, else None)
        self.fused: dict = {}
        self.dropped: set = set()  # vars of the group's other bindings, now inside its kernel
        self.order: dict = {}  # var -> the position of its binding in its block
        self.read_at: dict = {}  # var -> the positions of the bindings that read it
        self.kernels = UniqueKernels(self.builder_)

    def plan(self, func: relax.Function) -> None:
        self.fused, self.dropped = {}, set()
        weights, uses = packed_weights(func), use_counts(func)
        for block in func.body.blocks:
            # sequence-long kernels: decode's are FuseGEMVNorms'
            calls = {b.var: b for b in block.bindings if kernel_call(b) is not None and not decode_shapes(b.value)}
            self.order = {b.var: i for i, b in enumerate(block.bindings)}
            self.read_at = {}
            for i, binding in enumerate(block.bindings):
                for var in relax.analysis.free_vars(binding.value):
                    self.read_at.setdefault(var, []).append(i)

            def reads_weight(binding) -> bool:
                return any(isinstance(a, relax.Var) and a in weights for a in binding.value.args[1].fields)

            def only_read_by_one(var) -> relax.VarBinding | None:
                """The kernel binding of dataflow var `var`, if one kernel reads it once and nothing else does."""
                if var in calls and isinstance(var, relax.DataflowVar) and uses.get(var) == 1 \
                        and isinstance(calls[var].value.ty, relax.TensorType) and not reads_weight(calls[var]):
                    return calls[var]
                return None

            for gemm in (b for b in calls.values() if reads_weight(b) and isinstance(b.value.ty, relax.TensorType)):
                norm = next((b for a in gemm.value.args[1].fields if (b := only_read_by_one(a)) is not None
                             and reduces(self.mod[b.value.args[0]])), None)
                if norm is None:
                    continue
                # the cast of the norm's input (Gemma's float32 norm of a float16 row), if only the norm reads it
                cast = next((b for a in norm.value.args[1].fields if (b := only_read_by_one(a)) is not None
                             and moves_data(self.mod[b.value.args[0]])), None)
                # the norm kernel the first of them reads (Gemma 3's post-norm with its residual add)
                residual = next((calls[a] for a in (cast or norm).value.args[1].fields
                                 if a in calls and isinstance(a, relax.DataflowVar) and not reads_weight(calls[a])
                                 and isinstance(calls[a].value.ty, relax.TensorType)
                                 and reduces(self.mod[calls[a].value.args[0]])), None)
                # after it: kernels that move data (a reshape into heads), a norm over groups of its columns (the
                # q/k norm over each head), then kernels that compute on its result within each group (Gemma's
                # RoPE), each the only reader of the one before
                after, var, group_norm = [], gemm.var, None
                while (reader := self._only_reader(var, calls, uses)) is not None and not reads_weight(reader):
                    if reduces(self.mod[reader.value.args[0]]):
                        if group_norm is not None:
                            break
                        group_norm = len(after)
                    elif group_norm is None and not moves_data(self.mod[reader.value.args[0]]):
                        break
                    after.append(reader)
                    var = reader.var
                # the longest epilogue the schedule takes, then none
                tails = [after[:end] for end in range(len(after), group_norm, -1)] if group_norm is not None else []
                # with the residual prologue first, each with the longest epilogue the schedule takes
                befores = [[cast, norm], [norm]] if cast is not None else [[norm]]
                if residual is not None:
                    befores = [[residual, *befores[0]], *befores]
                for before in befores:
                    if any(self._try(before, gemm, tail) for tail in [*tails, []]):
                        break

    @staticmethod
    def _only_reader(var, calls: dict, uses: dict) -> relax.VarBinding | None:
        """The kernel binding that alone reads dataflow var `var`."""
        if not isinstance(var, relax.DataflowVar) or uses.get(var) != 1:
            return None
        return next((b for b in calls.values() if any(a.same_as(var) for a in b.value.args[1].fields)
                     and isinstance(b.value.ty, relax.TensorType)), None)

    def _try(self, before: list[relax.VarBinding], gemm: relax.VarBinding, after: list[relax.VarBinding]) -> bool:
        """Fuse the kernels of `before` (each read only by the next, but a first norm kernel whose result others
        read after the kernel: a second result) into `gemm`, and those of `after` (each reading only the one
        before) after it, if the schedule takes the result."""
        last = (after or [gemm])[-1]
        if any(b.var in self.fused or b.var in self.dropped for b in [*before, gemm, *after]):
            return False  # inside another GEMM's kernel already (a residual stream two norms read)
        first = before[0]
        second_result = first.var if len(self.read_at.get(first.var, [])) > 1 else None
        if second_result is not None and any(i <= self.order[last.var] and i != self.order[before[1].var]
                                             for i in self.read_at[first.var]):
            return False  # the residual stream read before the kernel ends
        built = chained_func(self.mod, Chain([*before, gemm, *after]), {}, {(last.var, 0)})
        if built is None:
            return False
        func, inputs, _ = built
        func = flattened(func)
        if second_result is not None:
            func = with_second_run(func, inputs, self.mod[first.value.args[0]], list(first.value.args[1].fields))
        func = func.with_attrs(dict(self.mod[gemm.value.args[0]].attrs))
        if not self.schedulable(func):
            return False
        norm = next(b for b in reversed(before) if reduces(self.mod[b.value.args[0]]))
        name = "_after_".join(b.value.args[0].name_hint for b in (gemm, norm))
        if norm is not first and reduces(self.mod[first.value.args[0]]):
            name = f"{name}_after_{first.value.args[0].name_hint}"
        if after:
            group_norm = next(b.value.args[0] for b in after if reduces(self.mod[b.value.args[0]]))
            name = f"{name}_then_{group_norm.name_hint}"
        self.fused[last.var] = (name, func, inputs, second_result)
        self.dropped.update(b.var for b in [*before, gemm, *after] if b is not last)
        return True

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if not emit_fused_binding(self, binding):
            super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="FuseGEMMNorms")
class FuseGEMMNorms:  # pylint: disable=too-few-public-methods
    """Fuse into each prefill GEMM the RMSNorm kernel that alone reads into its row operand, with that norm's input
    cast where only the norm reads it, and the norm kernel the first of them reads (Gemma 3's post-norm with its
    residual add; run a second time, last, into a second result where others read its result after the kernel); and
    after it the kernels that move its result (a reshape into heads), the norm over groups of it and the kernels that
    compute on that (RoPE), each alone reading the one before (compiler/passes/fuse_gemm_norms.py); after FuseTIR,
    before the schedule. `schedulable` says whether the schedule rules take a fused kernel: where they do not, a
    shorter epilogue, then none, then the prologue without the post-norm kernel, is tried."""

    def __init__(self, schedulable: Callable[[tirx.PrimFunc], bool]):
        self.schedulable = schedulable

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewritten = rewrite_relax_functions(mod, _Rewriter(mod, self.schedulable), plan=True)
        return relax.transform.DeadCodeElimination()(rewritten)  # the kernels now inside others
