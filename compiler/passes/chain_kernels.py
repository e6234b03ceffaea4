"""ChainKernels: consecutive CPU kernels become one kernel per weight-reading kernel (its prologue and epilogue), the
sequence-long results that only the chain reads held in buffers of its own, so that decode and prefill launch one
kernel per projection instead of one per operation without holding more activations."""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels.integer_dot_gemv import is_batch
from .ir_walk import OPAQUE, UniqueKernels, packed_weights

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_CALL_PURE_PACKED = tvm.ir.Op.get("relax.call_pure_packed")


@dataclasses.dataclass
class Chain:
    """Kernel-call bindings run in this order as one kernel (`anchor`: the one that reads a weight, if any), and the
    pure bindings between them that read none of their results, emitted before it."""

    bindings: list[relax.VarBinding]
    anchor: relax.VarBinding | None = None
    hoisted: list[relax.VarBinding] = dataclasses.field(default_factory=list)


def kernel_call(binding) -> relax.Call | None:
    """The call_tir of `binding` when it calls a PrimFunc with plain arguments (no symbolic-shape arguments)."""
    value = binding.value if isinstance(binding, relax.VarBinding) else None
    if isinstance(value, relax.Call) and value.op == _CALL_TIR and len(value.args) == 2:
        return value
    return None


def _outputs(call: relax.Call) -> list:
    return list(call.ty.fields) if isinstance(call.ty, relax.TupleType) else [call.ty]


def decode_shapes(call: relax.Call) -> bool:
    """Whether every result of `call` has decode's shape: fixed dimensions, or batch_decode's row per sequence (BATCH,
    at most a few). A chain keeps such results its results even where only it reads them: Relax plans them once and
    they are small, while as buffers of the kernel's own (stack arrays, which LLVM may fold) they changed Gemma 3
    q0f32's decode logits by up to 6e-6; a sequence-long one is heap scratch, and prefill's logits stay the same."""
    return all(isinstance(ty, relax.TensorType) and ty.shape is not None and all(
        isinstance(d, tirx.IntImm) or is_batch(d) for d in ty.shape.values)
        for ty in _outputs(call))


def _reads(expr) -> list:
    found = []
    relax.analysis.post_order_visit(expr, lambda e: found.append(e) if isinstance(e, relax.Var) else None)
    return found


def _readers(func: relax.Function) -> dict:
    """Var -> the vars of the bindings that read it (None: the function's result)."""
    readers: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            for var in _reads(binding.value):
                readers.setdefault(var, set()).add(binding.var)
    for var in _reads(func.body.body):
        readers.setdefault(var, set()).add(None)
    return readers


def _chain_results(chain: Chain, readers: dict, items: dict) -> set:
    """(var of a chain kernel's binding, result index) of the chained kernel's results: those of decode's shapes
    (decode_shapes), and those something outside the chain reads: another binding (directly or through a tuple item),
    a later block or the function's result. A sequence-long result only the chain reads is a buffer of the kernel's
    own (heap scratch from the runtime's pool, given back when the call ends): as a result of the call it would be
    live beside all the others, and prefill's would grow the memory plan (SmolLM2: 77 -> 98 MB)."""
    members = {b.var for b in chain.bindings}

    def outside(var) -> bool:
        return not isinstance(var, relax.DataflowVar) or bool(readers.get(var, set()) - members)

    of_tuple: dict = {}  # var of a chain kernel's tuple result -> {index: its item vars}
    for var, (tuple_var, index) in items.items():
        of_tuple.setdefault(tuple_var, {}).setdefault(index, []).append(var)
    read = set()
    for binding in chain.bindings:
        by_index = of_tuple.get(binding.var, {})
        item_vars = {v for vs in by_index.values() for v in vs}
        # decode's shapes, the block's output, or (a tuple) read other than by its items: every result
        whole = (decode_shapes(binding.value) or not isinstance(binding.var, relax.DataflowVar)
                 or bool(readers.get(binding.var, set()) - members - item_vars))
        for index in range(len(_outputs(binding.value))):
            if whole or any(outside(v) for v in by_index.get(index, ())):
                read.add((binding.var, index))
    return read


class _Planner:
    """Splits each binding block into chains. A run is a sequence of kernel calls with nothing between them but the
    tuple items of their results and pure calls that read none of them (the KV cache's query positions); in a run,
    each kernel that reads a weight of two or more dimensions (a projection, the embedding) takes the kernels
    before it since the previous one (its prologue), and the last one also those after it (its epilogue)."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        self.mod = mod
        self.weights = packed_weights(func)

    def _independent(self, binding, produced: set) -> bool:
        """A binding a chain may run after: a pure call or tuple item that reads nothing the run produced."""
        value = binding.value if isinstance(binding, relax.VarBinding) else None
        call = isinstance(value, relax.Call) and value.op == _CALL_PURE_PACKED
        pure = call or isinstance(value, relax.TupleGetItem)
        return pure and not any(v in produced for v in _reads(value))

    def chains(self, block) -> list[Chain]:
        runs, run, between, produced = [], [], [], set()
        for binding in block.bindings:
            call = kernel_call(binding)
            if call is not None and isinstance(self.mod[call.args[0]], tirx.PrimFunc):
                run.append(binding)
                produced.add(binding.var)
            elif (run and isinstance(binding.value, relax.TupleGetItem)
                  and any(binding.value.tuple_value.same_as(v) for v in produced)):
                produced.add(binding.var)
            elif run and self._independent(binding, produced):
                between.append((len(run), binding))  # after run[len(run) - 1]
            else:
                runs.append((run, between))
                run, between, produced = [], [], set()
        runs.append((run, between))
        chains = []
        for members, others in runs:
            split = self._split(members)
            start = 0
            for chain in split:
                end = start + len(chain.bindings)
                chain.hoisted = [b for after, b in others if start < after < end]
                start = end
            chains.extend(c for c in split if len(c.bindings) > 1)
        return chains

    def _split(self, run: list[relax.VarBinding]) -> list[Chain]:
        chains, current = [], Chain([])
        for binding in run:
            reads_weight = any(isinstance(a, relax.Var) and a in self.weights for a in binding.value.args[1].fields)
            if reads_weight and current.anchor is not None:
                chains.append(current)
                current = Chain([])
            current.bindings.append(binding)
            if reads_weight:
                current.anchor = binding
        chains.append(current)
        # kernels after a chain's anchor but before the next chain's belong to the next: moved forward
        for earlier, later in zip(chains, chains[1:]):
            if earlier.anchor is not None:
                cut = earlier.bindings.index(earlier.anchor) + 1
                later.bindings[:0], earlier.bindings[cut:] = earlier.bindings[cut:], []
        return [chain for chain in chains if chain.bindings]


def same_buffer(a, b) -> bool:
    """Whether kernel parameter `a` can be bound to the chain's buffer `b` as it stands (fixed shapes: by rank)."""
    return a.dtype == b.dtype and len(a.shape) == len(b.shape)


def chained_func(mod: tvm.IRModule, chain: Chain, items: dict, read: set
                  ) -> tuple[tirx.PrimFunc, list[relax.Expr], list] | None:
    """One PrimFunc running the chain's kernels in order, its Relax inputs and its results ((var of a chain kernel's
    binding, result index) in `read`, in order; the others are buffers of its own); `items` maps a tuple item's var
    to (tuple var, index). None where a kernel's parameter does not take the buffer it is given as it stands (another
    dtype or rank)."""
    inputs: list[relax.Expr] = []
    input_params, output_params, results, own, bodies = [], [], [], [], []
    produced: dict = {}  # (Relax var of a chain kernel's result, index) -> the buffer that holds it
    seen = set()
    for binding in chain.bindings:
        func = mod[binding.value.args[0]]
        if binding.value.args[0] in seen:  # a kernel that comes twice: a copy with variables of its own
            func = tvm.ir.load_json(tvm.ir.save_json(func))
        seen.add(binding.value.args[0])
        args, params = list(binding.value.args[1].fields), list(func.params)
        pairs: list[tuple] = []  # this kernel's parameter buffers -> the chain's
        for arg, param in zip(args, params):
            key = items.get(arg, (arg, 0))
            source = produced.get(key)
            if source is None:
                index = next((i for i, known in enumerate(inputs) if known.same_as(arg)), None)
                if index is None:
                    inputs.append(arg)
                    input_params.append(param)
                    continue
                source = input_params[index]
            if not same_buffer(param, source):
                return None
            pairs.append((param, source))
            # the kernel's own symbolic dimensions (batch_decode's rows, prefill's sequence) are the chain buffer's
            pairs.extend((mine, theirs) for mine, theirs in zip(param.shape, source.shape)
                         if isinstance(mine, tirx.Var) and not mine.same_as(theirs))

        def replace(var, pairs=pairs):
            return next((new for old, new in pairs if var.same_as(old)), var)

        def mapped(node, replace=replace):
            return tvm_ffi.structural_map(node, [(tvm.ir.expr.Var, replace)])

        for i, out in enumerate(params[len(args):]):
            # in the chain's dimension variables (a buffer's shape is not mapped with its uses), the same data
            out, old = tirx.decl_buffer([mapped(d) for d in out.shape], out.dtype, out.name, data=out.data,
                                        data_alignment=out.data_alignment, layout=out.layout), out
            pairs.append((old, out))
            if (binding.var, i) in read:
                output_params.append(out)
                results.append((binding.var, i))
            else:
                own.append(out)
            produced[(binding.var, i)] = out
        bodies.append(mapped(func.body))
    if not results:
        return None
    root = s_tir.SBlock([], [], [], "root", tirx.SeqStmt(bodies), alloc_buffers=own)
    # s_tir: the kernels' blocks are s_tir blocks, as each part says of itself
    marks = {key: True for key in ("s_tir",) if any(mod[b.value.args[0]].attrs.get(key) for b in chain.bindings)}
    merged = tirx.PrimFunc([*input_params, *output_params], s_tir.SBlockRealize([], True, root)).with_attrs(
        {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": OPAQUE, **marks})
    return merged, inputs, results


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod
        self.first: dict = {}  # var of a chain's first binding -> (chain, its PrimFunc, its inputs, its results)
        self.later: set = set()  # vars of the chains' other bindings (and the bindings they hoist): emitted first
        self.items: dict = {}  # var of a chain kernel's tuple result -> {index: its item of the chained call}
        self.item_bindings: dict = {}  # var of a tuple-item binding -> the binding
        self.emitted: set = set()  # tuple-item bindings emitted ahead of their place (a chain reads them first)
        self.kernels = UniqueKernels(self.builder_)

    def plan(self, func: relax.Function) -> None:
        self.first, self.later, self.items, self.item_bindings, self.emitted = {}, set(), {}, {}, set()
        planner, readers = _Planner(self.mod, func), _readers(func)
        for block in func.body.blocks:
            items = {b.var: (b.value.tuple_value, b.value.index) for b in block.bindings
                     if isinstance(b.value, relax.TupleGetItem)}
            self.item_bindings.update((b.var, b) for b in block.bindings if isinstance(b.value, relax.TupleGetItem))
            for chain in planner.chains(block):
                built = chained_func(self.mod, chain, items, _chain_results(chain, readers, items))
                if built is None:
                    continue
                self.first[chain.bindings[0].var] = (chain, *built)
                self.later.update(b.var for b in chain.bindings[1:] + chain.hoisted)
                # the tuple items of results the chain keeps inside: read by nothing outside it, not emitted
                self.later.update(v for v, (t, i) in items.items() if any(t.same_as(b.var) for b in chain.bindings)
                                  and (t, i) not in built[2])

    def _emit_item(self, binding: relax.VarBinding) -> None:
        """A tuple item of an earlier chain's result, read from the chained call's."""
        value = binding.value
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(self.items[value.tuple_value][value.index], binding.var.name))
        self.emitted.add(binding.var)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.later or binding.var in self.emitted:
            return
        value = binding.value
        if isinstance(value, relax.TupleGetItem) and value.tuple_value in self.items:
            self._emit_item(binding)
            return
        if binding.var not in self.first:
            super().visit_var_binding_(binding)
            return
        chain, func, inputs, results = self.first[binding.var]
        for hoisted in chain.hoisted:
            super().visit_var_binding_(hoisted)
        # an earlier chain's tuple item this chain reads may stand later in the block, among this chain's bindings
        # (prefill_hidden_states: the residual beside the layers' outputs it is concatenated with)
        for var in inputs:
            item = self.item_bindings.get(var)
            if item is not None and var not in self.emitted and item.value.tuple_value in self.items:
                self._emit_item(item)
        anchor = chain.anchor or chain.bindings[0]
        gv = self.kernels.add(func, f"{anchor.value.args[0].name_hint}_chained")
        types = {(b.var, i): ty for b in chain.bindings for i, ty in enumerate(_outputs(b.value))}
        merged = self.builder_.emit(relax.call_tir(gv, [self.visit_expr(i) for i in inputs],
                                                   [types[r] for r in results]), "chained")

        def result(position: int) -> relax.Expr:  # a call of one result returns it, not a tuple
            return merged if len(results) == 1 else relax.TupleGetItem(merged, position)

        for b in chain.bindings:
            positions = {i: results.index((var, i)) for var, i in results if var.same_as(b.var)}
            if not positions:
                continue
            if isinstance(b.value.ty, relax.TupleType):
                # its tuple items are read from the chained call's; the tuple itself, where something else reads it
                self.items[b.var] = {i: result(p) for i, p in positions.items()}
                if len(positions) < len(b.value.ty.fields):
                    continue
                value = relax.Tuple([result(positions[i]) for i in range(len(positions))])
            else:
                value = result(positions[0])
            emit = self.builder_.emit if isinstance(b.var, relax.DataflowVar) else self.builder_.emit_output
            self.set_var_remap(b.var, emit(value, b.var.name))


@tvm.transform.module_pass(opt_level=0, name="ChainKernels")
class ChainKernels:  # pylint: disable=too-few-public-methods
    """Chain consecutive scheduled CPU kernels (compiler/passes/chain_kernels.py); after the schedule step, before
    the dataflow is lowered. Each chained kernel runs its parts' code unchanged, in the same order, writing the
    same values (prefill's that only it reads to buffers of its own): results are bit-identical, one VM call replaces
    several."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.plan(func)
                rewriter.builder_.update_func(gv, relax.analysis.remove_all_unused(rewriter.visit_expr(func)))
        # the kernels now only inside chains are not built on their own
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
