"""The TE dequantize of a GroupLayout's stored arrays, which the compiled kernels inline into the matmul (or
embedding lookup) that reads the weights."""

from __future__ import annotations

from tvm import te, tirx

from .group import NIBBLE_BLOCK, GroupLayout


def _code(q: te.Tensor, row, col, layout: GroupLayout):
    if layout.bits == 8:
        return q[row, col].astype("int32")
    half = NIBBLE_BLOCK // 2
    byte = q[row, col // NIBBLE_BLOCK * half + col % half].astype("int32")
    return (byte >> (col % NIBBLE_BLOCK // half * 4)) & 0xF


def _value(code, scale, minv, layout: GroupLayout, dtype: str):
    if layout.symmetric:
        # code * s + (-offset * s), not (code - offset) * s: LLVM contracts the former into one FMA per vector
        # (the per-group term is computed once per scale load), one instruction fewer in every GEMV inner loop.
        minv = scale.astype(dtype) * tirx.const(-layout.offset, dtype)
    # The scale is read first: dlight's gpu.GEMV splits K by the index of the first read that depends on both
    # row and K, and the scale's k // group is a split it can take (the codes' nibble index is two splits).
    return scale.astype(dtype) * code.astype(dtype) + minv.astype(dtype)


def dequantize_te(layout: GroupLayout, k: int, dtype: str):
    """A TE function (q_weight, q_scale[, q_min]) -> [n, k] weights in `dtype`; inlined into the consuming matmul."""

    def compute(q: te.Tensor, scale: te.Tensor, minv: te.Tensor | None = None) -> te.Tensor:
        n = q.shape[0]
        return te.compute(
            (n, k),
            lambda i, j: _value(_code(q, i, j, layout), scale[i, j // layout.group],
                                None if minv is None else minv[i, j // layout.group], layout, dtype),
            name="dequantize",
        )

    return compute


def take_dequantize_te(layout: GroupLayout, k: int, dtype: str):
    """A TE function (ids, q_weight, q_scale[, q_min]) -> [len(ids), k]: embedding rows, dequantized on the fly."""

    def compute(ids: te.Tensor, q: te.Tensor, scale: te.Tensor, minv: te.Tensor | None = None) -> te.Tensor:
        def value(i, j):
            row = ids[i]
            return _value(_code(q, row, j, layout), scale[row, j // layout.group],
                          None if minv is None else minv[row, j // layout.group], layout, dtype)

        return te.compute((ids.shape[0], k), value, name="take_dequantize")

    return compute
