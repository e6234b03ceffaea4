"""The TE dequantize of a GroupLayout's stored arrays, which the compiled kernels inline into the matmul (or
embedding lookup) that reads the weights."""

from __future__ import annotations

from tvm import te, tirx

from .group import (HVX_HALF_GROUP, HVX_ROWS, INTERLEAVE, NIBBLE_BLOCK, GroupLayout, hvx_record_bytes,
                    interleaved_bytes, paired_position)
from .hvx_blocks import VECTOR_BYTES


def _byte_index(col, layout: GroupLayout, row_bytes: int):
    """Where code `col` is among a row's `row_bytes` bytes in the neon or plain order (neon_pairs: before pairing)."""
    block_bytes = NIBBLE_BLOCK * layout.bits // 8
    block, in_block = col // NIBBLE_BLOCK, col % block_bytes  # 4-bit: byte j holds codes j and j + 16
    plain = block * block_bytes + in_block
    if layout.code_order == "plain":
        return plain
    blocks, chunk = INTERLEAVE[layout.bits]  # chunk c of block i of a set: the set's c-th chunks, i-th of them
    interleaved = (block // blocks * blocks * block_bytes + in_block // chunk * blocks * chunk + block % blocks * chunk
                   + in_block % chunk)
    prefix = interleaved_bytes(row_bytes, layout.bits)
    if prefix == row_bytes:  # every byte in a set
        return interleaved
    return tirx.Select(block < prefix // block_bytes, interleaved, plain)


def _code(q: te.Tensor, row, col, layout: GroupLayout):
    row_bytes = int(q.shape[1])
    index = _byte_index(col, layout, row_bytes)
    nibble = col % NIBBLE_BLOCK // (NIBBLE_BLOCK // 2)  # 4-bit: the low or high nibble of its neon byte
    if layout.code_order == "neon_pairs":
        # row 2p + 1's nibble ^ 8 in the high half of each byte
        odd = row % 2
        byte = q[paired_position(row - odd, index, nibble, row_bytes)].astype("int32")
        return ((byte >> (odd * 4)) & 0xF) ^ (odd * 8)
    byte = q[row, index].astype("int32")
    if layout.bits == 8:
        return byte ^ 0x80 if layout.signed_codes else byte
    return (byte >> (nibble * 4)) & 0xF


def _value(code, scale, minv, layout: GroupLayout, dtype: str):
    if layout.symmetric:
        # code * s + (-offset * s), not (code - offset) * s: LLVM contracts the former into one FMA per vector
        # (the per-group term is computed once per scale load), one instruction fewer in every GEMV inner loop.
        minv = scale.astype(dtype) * tirx.const(-layout.offset, dtype)
    # The scale is read first: dlight's gpu.GEMV splits K by the index of the first read that depends on both
    # row and K, and the scale's k // group is a split it can take (the codes' nibble index is two splits).
    return scale.astype(dtype) * code.astype(dtype) + minv.astype(dtype)


def _hvx_value(q: te.Tensor, factors: te.Tensor, row, col, layout: GroupLayout, dtype: str):
    """Weight (row, col) of the "hvx" order (quantization/hvx_blocks.py): tile t's record of the pair of blocks col
    falls in, at byte (t * pairs + pair) * hvx_record_bytes + offset of the flat records, q [n, row_bytes]."""
    row_bytes = int(q.shape[1])
    halves = layout.hvx_halves  # a scale vector per block, its halfwords the half blocks'
    record = hvx_record_bytes(layout.bits, not layout.symmetric, halves)
    tile, lane = row // HVX_ROWS, row % HVX_ROWS
    pair, block, in_block = col // (2 * NIBBLE_BLOCK), col // NIBBLE_BLOCK % 2, col % NIBBLE_BLOCK

    def byte(offset):
        at = pair * record + offset
        return q[tile * HVX_ROWS + at // row_bytes, at % row_bytes].astype("int32")

    def fixed(which: int):  # the int16 of this row and block (halves: half block) among the scales (0) or mins (1)
        if halves:
            at = (2 * which + block) * VECTOR_BYTES + 4 * lane + 2 * (in_block // HVX_HALF_GROUP)
        else:
            at = which * VECTOR_BYTES + 4 * lane + 2 * block
        low, high = byte(at), byte(at + 1)
        return (low | (high << 8)) - ((high >> 7) << 16)

    def factor(which: int):  # row_factors [tiles, 2, 32] seen as [n, 2]
        at = which * HVX_ROWS + lane
        return factors[tile * HVX_ROWS + at // 2, at % 2]

    codes = (2 - layout.symmetric) * (1 + halves) * VECTOR_BYTES + block * layout.bits * VECTOR_BYTES
    if layout.bits == 4:  # vector in_block // 8, code 8 v + j low and 8 v + 4 + j high
        code = (byte(codes + in_block // 8 * VECTOR_BYTES + 4 * lane + in_block % 4) >> (in_block % 8 // 4 * 4)) & 0xF
    else:  # vector in_block // 4
        code = byte(codes + in_block // 4 * VECTOR_BYTES + 4 * lane + in_block % 4)
    scale = fixed(0).astype(dtype) * factor(0).astype(dtype)
    if layout.symmetric:
        return scale * (code - layout.offset).astype(dtype)
    return scale * code.astype(dtype) + fixed(1).astype(dtype) * factor(1).astype(dtype)


def dequantize_te(layout: GroupLayout, k: int, dtype: str):
    """A TE function (q_weight, q_scale[, q_min]) -> [n, k] weights in `dtype`; inlined into the consuming matmul."""

    def compute(q: te.Tensor, scale: te.Tensor, minv: te.Tensor | None = None) -> te.Tensor:
        n = q.shape[0]
        if layout.code_order == "hvx":
            return te.compute((n, k), lambda i, j: _hvx_value(q, scale, i, j, layout, dtype), name="dequantize")
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
            if layout.code_order == "hvx":
                return _hvx_value(q, scale, row, j, layout, dtype)
            return _value(_code(q, row, j, layout), scale[row, j // layout.group],
                          None if minv is None else minv[row, j // layout.group], layout, dtype)

        return te.compute((ids.shape[0], k), value, name="take_dequantize")

    return compute
