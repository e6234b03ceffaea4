"""aarch64 variants of the integer prefill GEMM's block product: a 4-lane int32 tile of X rows times W rows over one
32-value block, with NEON's int8 matrix multiply (i8mm) or indexed dot product (dotprod).

- i8mm: `smmla` multiplies two rows of 8 int8 by two rows of 8 int8 into a 2x2 int32 tile; 4 of them cover a block
  for 2 W rows (first operand) x 2 X rows (second), lanes [n0 m0, n0 m1, n1 m0, n1 m1]. X is stored in pairs of rows,
  8 values of each per 16 bytes (the activation kernel writes that order), one load per operand. A W pair is
  two 8-byte halves joined (`zip1`/`zip2` .2d); for 4-bit codes the halves are joined before the nibbles are split,
  so a block of 2 rows is 2 loads, 2 zips, 2 ANDs and 2 shifts. 8-bit codes 0..255 go into `usmmla` (unsigned x
  signed) as they are; 4-bit codes 0..15 are valid int8 and go into `smmla`.
- dotprod: `sdot` by element: the first operand holds 4 X rows x 4 values, the second one 32-bit lane of a W row
  (4 values) repeated; lane i sums row i's 4 products. 8 per block give a column of 4 outputs without horizontal
  sums. 8-bit codes go in as c - 128 (one EOR per 16 codes, as the GEMV's `centered`), which drops the symmetric
  offset term.
"""

from __future__ import annotations

from tvm.script import tirx as T

# int_dot family (compiler/isa.py) -> X rows per 16-byte activation vector: smmla pairs, sdot fours
ROWS_PER_VECTOR = {"i8mm": 2, "dotprod": 4}
FAMILIES = tuple(ROWS_PER_VECTOR)
LANES = 4  # int32 lanes of a tile


def rows_per_vector(family: str) -> int:
    return ROWS_PER_VECTOR[family]


def columns_per_tile(family: str) -> int:
    """W rows a 4-lane tile covers: lane l is X row l % rows_per_vector and W row l // rows_per_vector."""
    return LANES // ROWS_PER_VECTOR[family]


def centered(shape) -> bool:
    """8-bit codes go into `sdot` as c - 128 (no unsigned x signed product without i8mm)."""
    return shape.bits == 8 and shape.family == "dotprod"


def _codes(shape, w, n, block, half):
    """16 code bytes of W row n for block `block`: 4-bit codes 0..15 (half 0: block values 0-15, 1: 16-31)."""
    if shape.bits == 4:
        packed = w[n, T.ramp(block * 16, 1, 16)]
        return (T.bitwise_and(packed, T.broadcast(T.uint8(15), 16)) if half == 0
                else T.shift_right(packed, T.broadcast(T.uint8(4), 16)))
    codes = w[n, T.ramp(block * 32 + half * 16, 1, 16)]
    return T.bitwise_xor(codes, T.broadcast(T.uint8(128), 16)) if centered(shape) else codes


def _pair_operand(shape, w, n, block, chunk):
    """W rows n, n + 1, values 8 chunk .. 8 chunk + 7 of the block, row n in bytes 0-7: the first operand of smmla."""
    if shape.bits == 4:
        # join 8-byte halves of the packed bytes, then split nibbles: chunks 0, 1 low nibbles, 2, 3 high
        packed = [w[n + r, T.ramp(block * 16 + chunk % 2 * 8, 1, 8)] for r in (0, 1)]
        joined = T.Shuffle(packed, list(range(16)))
        return (T.bitwise_and(joined, T.broadcast(T.uint8(15), 16)) if chunk < 2
                else T.shift_right(joined, T.broadcast(T.uint8(4), 16)))
    return T.Shuffle([w[n + r, T.ramp(block * 32 + chunk * 8, 1, 8)] for r in (0, 1)], list(range(16)))


def _lane(codes, index: int):
    """32-bit lane `index` of 16 code bytes repeated 4 times, as int8x16 (LLVM folds it into sdot's element form)."""
    return T.reinterpret("int8x16", T.Shuffle([T.reinterpret("int32x4", codes)], [index] * 4))


def block_dot(shape, w, xq, n, block, x_vector):
    """int32x4: the tile of W rows from n (columns_per_tile of them) times the X rows of activation vectors
    `x_vector(chunk)` (16 bytes; chunk: 8 values per vector with i8mm, 4 with dotprod) over block `block`."""
    acc = T.broadcast(T.int32(0), LANES)
    if shape.family == "i8mm":
        name = "llvm.aarch64.neon.usmmla.v4i32.v16i8" if shape.bits == 8 else "llvm.aarch64.neon.smmla.v4i32.v16i8"
        for chunk in range(4):
            codes = _pair_operand(shape, w, n, block, chunk)
            acc = T.call_llvm_pure_intrin("int32x4", name, acc, codes if shape.bits == 8 else
                                          T.reinterpret("int8x16", codes), xq[x_vector(block * 4 + chunk)])
        return acc
    for half in (0, 1):
        codes = _codes(shape, w, n, block, half)
        for index in range(4):
            acc = T.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.sdot.v4i32.v16i8", acc,
                                          xq[x_vector(block * 8 + half * 4 + index)], _lane(codes, index))
    return acc
