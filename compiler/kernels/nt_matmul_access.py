"""The accesses of an NT-matmul kernel Y[m, n] (+ epilogue) = sum_k x(m, k) * w(n, k), read from its TIR blocks as
PrimExpr builders over new indices (prefill_gemm.GemmAccess): the GEMM template then serves every weight layout
(dequantized in the producer block, or read as it is) and every epilogue."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir.dlight.analysis import collect_vars_used_in_prim_expr
from tvm.s_tir.dlight.analysis.gemv import get_reduction_expr

from .prefill_gemm import GemmAccess


def _substitute(expr, vars_to: list[tuple[tirx.Var, tirx.PrimExpr]], load_of=None):
    """`expr` with each var of `vars_to` replaced, and each load of buffer `load_of[0]` by `load_of[1]` (the
    load's indices already substituted)."""

    def var(v):
        new = next((new for old, new in vars_to if old.same_as(v)), None)
        if new is None:
            return v
        # The kernel's indices are int64; a block of int32 iters keeps its own index type.
        return new if str(new.ty) == str(v.ty) else tirx.Cast(str(v.ty), new)

    def load(node):
        return load_of[1](node) if node.source.same_as(load_of[0]) else node

    callbacks = [(tvm.ir.expr.Var, var)]
    if load_of is not None:
        callbacks.append((tvm.ir.expr.TensorLoad, load))
    return tvm_ffi.structural_map(expr, callbacks)


def _loads(expr) -> list:
    found = []
    tvm_ffi.structural_walk(expr, (tvm.ir.expr.TensorLoad, found.append))
    return found


def read(func: tirx.PrimFunc, block: tirx.SBlock, eblock: tirx.SBlock | None,
         pblock: tirx.SBlock | None) -> GemmAccess | None:
    """The reads and writes of `func`'s matmul `block` (with its epilogue `eblock` and weight producer `pblock`,
    as dlight's NT-matmul match found them) as builders over new indices, or None when it is not
    Y[m, n] (+ epilogue) = sum_k x(m, k) * w(n, k) with one row axis m and static N, K."""
    if len(block.iter_vars) != 3 or [int(iv.iter_type) for iv in block.iter_vars] != [0, 0, 2]:
        return None
    m, n, k = (iv.var for iv in block.iter_vars)
    m_ext, n_ext, k_ext = (iv.dom.extent for iv in block.iter_vars)
    if not isinstance(n_ext, tirx.IntImm) or not isinstance(k_ext, tirx.IntImm):
        return None
    if any(not isinstance(iv.dom.min, tirx.IntImm) or iv.dom.min.value != 0 for iv in block.iter_vars):
        return None
    red = get_reduction_expr(block)
    # float32 products summed in float32 (the kernel's tiles are float32)
    if not isinstance(red, tirx.Mul) or any(str(e.ty) != "float32" for e in (red, red.a, red.b)):
        return None
    sides = []
    for side in (red.a, red.b):
        used = set().union(*(collect_vars_used_in_prim_expr(i) for load in _loads(side) for i in load.indices))
        sides.append("w" if n in used and m not in used else "x" if m in used and n not in used else None)
    if sorted(sides) != ["w", "x"]:
        return None
    x_side, w_side = (red.a, red.b) if sides[0] == "x" else (red.b, red.a)
    params = list(func.params)

    def is_param(buf) -> bool:
        return any(p.same_as(buf) for p in params)

    if any(not is_param(load.source) for load in _loads(x_side)):
        return None
    w_load_of = None
    if pblock is not None:
        store = pblock.body
        pvars = [iv.var for iv in pblock.iter_vars]
        if (not isinstance(store, tirx.BufferStore) or len(pvars) != 2
                or not all(isinstance(i, tvm.ir.expr.Var) and i.same_as(v) for i, v in zip(store.indices, pvars))):
            return None
        for load in _loads(w_side):
            if not load.source.same_as(store.buffer) or len(load.indices) != 2:
                return None
        if any(not is_param(load.source) for load in _loads(store.value)):
            return None

        def dequantized(load, pvars=pvars, value=store.value):
            return _substitute(value, list(zip(pvars, load.indices)))

        w_load_of = (store.buffer, dequantized)
    elif any(not is_param(load.source) for load in _loads(w_side)):
        return None

    out = block.body
    if not isinstance(out, tirx.BufferStore):
        return None
    if eblock is None:
        if not is_param(out.buffer):
            return None

        def store(mm, nn, value):
            return out.buffer, [_substitute(i, [(m, mm), (n, nn)]) for i in out.indices], value
    else:
        estore = eblock.body
        evars = [iv.var for iv in eblock.iter_vars]
        if not isinstance(estore, tirx.BufferStore) or len(evars) != 2 or not is_param(estore.buffer):
            return None
        expect = [_substitute(i, [(m, evars[0]), (n, evars[1])]) for i in out.indices]
        inter = [load for load in _loads(estore.value) if load.source.same_as(out.buffer)]
        if not inter or any(not tvm_ffi.structural_equal(list(load.indices), expect) for load in inter):
            return None
        if any(not is_param(load.source) for load in _loads(estore.value) if not load.source.same_as(out.buffer)):
            return None

        def store(mm, nn, value):
            subs = [(evars[0], mm), (evars[1], nn)]
            return (estore.buffer, [_substitute(i, subs) for i in estore.indices],
                    _substitute(estore.value, subs, (out.buffer, lambda _load: value)))

    return GemmAccess(
        m=m_ext, n=int(n_ext.value), k=int(k_ext.value),
        x=lambda mm, kk: _substitute(x_side, [(m, mm), (k, kk)]),
        w=lambda nn, kk: _substitute(w_side, [(n, nn), (k, kk)], w_load_of),
        store=store,
    )
