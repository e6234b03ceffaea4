"""FuseGEMMNorms: on GPUs, the RMSNorm before a prefill GEMM, and a q/k norm over heads after it, run inside it."""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, s_tir, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .chain_kernels import Chain, chained_func, decode_shapes, kernel_call
from .fuse_gemv_norms import moves_data, reduces
from .ir_walk import AskedOnce, UniqueKernels, packed_weights, rewrite_relax_functions, stmts_of, use_counts


def _flattened(func: tirx.PrimFunc) -> tirx.PrimFunc:
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
        self.fused: dict = {}  # var of a group's last binding -> (kernel name, fused PrimFunc, its Relax inputs)
        self.dropped: set = set()  # vars of the group's other bindings, now inside its kernel
        self.kernels = UniqueKernels(self.builder_)

    def plan(self, func: relax.Function) -> None:
        self.fused, self.dropped = {}, set()
        weights, uses = packed_weights(func), use_counts(func)
        for block in func.body.blocks:
            # sequence-long kernels: decode's are FuseGEMVNorms'
            calls = {b.var: b for b in block.bindings if kernel_call(b) is not None and not decode_shapes(b.value)}

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
                # after it: kernels that move data (a reshape into heads), then a norm over groups of its columns (the
                # q/k norm over each head), each the only reader of the one before
                after, var = [], gemm.var
                while (reader := self._only_reader(var, calls, uses)) is not None:
                    after.append(reader)
                    if not moves_data(self.mod[reader.value.args[0]]):
                        break
                    var = reader.var
                if not after or not reduces(self.mod[after[-1].value.args[0]]):
                    after = []
                for before in ([cast, norm], [norm]) if cast is not None else ([norm],):
                    if any(self._try(before, gemm, tail) for tail in ([after, []] if after else [[]])):
                        break

    @staticmethod
    def _only_reader(var, calls: dict, uses: dict) -> relax.VarBinding | None:
        """The kernel binding that alone reads dataflow var `var`."""
        if not isinstance(var, relax.DataflowVar) or uses.get(var) != 1:
            return None
        return next((b for b in calls.values() if any(a.same_as(var) for a in b.value.args[1].fields)
                     and isinstance(b.value.ty, relax.TensorType)), None)

    def _try(self, before: list[relax.VarBinding], gemm: relax.VarBinding, after: list[relax.VarBinding]) -> bool:
        """Fuse the kernels of `before` (each read only by the next) into `gemm`, and those of `after` (each reading
        only the one before) after it, if the schedule takes the result."""
        last = (after or [gemm])[-1]
        built = chained_func(self.mod, Chain([*before, gemm, *after]), {}, {(last.var, 0)})
        if built is None:
            return False
        func, inputs, _ = built
        func = _flattened(func).with_attrs(dict(self.mod[gemm.value.args[0]].attrs))
        if not self.schedulable(func):
            return False
        name = "_after_".join(b.value.args[0].name_hint for b in (gemm, before[-1]))
        if after:
            name = f"{name}_then_{after[-1].value.args[0].name_hint}"
        self.fused[last.var] = (name, func, inputs)
        self.dropped.update(b.var for b in [*before, gemm, *after] if b is not last)
        return True

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.dropped:
            return
        if binding.var not in self.fused:
            super().visit_var_binding_(binding)
            return
        name, func, inputs = self.fused[binding.var]
        call = relax.call_tir(self.kernels.add(func, name), [self.visit_expr(i) for i in inputs], binding.value.ty)
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(call, binding.var.name))


@tvm.transform.module_pass(opt_level=0, name="FuseGEMMNorms")
class FuseGEMMNorms:  # pylint: disable=too-few-public-methods
    """Fuse into each prefill GEMM the RMSNorm kernel that alone reads into its row operand, with that norm's input
    cast where only the norm reads it, and after it the kernels that move its result (a reshape into heads) and the
    norm over groups of it that alone read them (compiler/passes/fuse_gemm_norms.py); after FuseTIR, before the
    schedule. `schedulable` says whether the schedule rules take a fused kernel: where they do not, the epilogue,
    then the whole, stays apart."""

    def __init__(self, schedulable: Callable[[tirx.PrimFunc], bool]):
        self.schedulable = schedulable

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewritten = rewrite_relax_functions(mod, _Rewriter(mod, self.schedulable), plan=True)
        return relax.transform.DeadCodeElimination()(rewritten)  # the kernels now inside others
