"""aarch64 variants of the integer prefill GEMM's block product: a 4-lane int32 tile of X rows times W rows over one
32-value block, with NEON's int8 matrix multiply (i8mm) or indexed dot product (dotprod).

- i8mm: `smmla` multiplies two rows of 8 int8 by two rows of 8 int8 into a 2x2 int32 tile; 4 of them cover a block
  for 2 X rows (first operand) x 2 W rows (second), lanes [m0 n0, m0 n1, m1 n0, m1 n1]. X is stored in pairs of
  rows, 8 values of each per 16 bytes (the activation kernel writes that order), one load per operand. W in the
  "neon" code order (quantization/group.py: sets of 4 blocks interleaved by 4 bytes, for the decode GEMV) is first
  re-laid per task (GemmShape.relays, relaid_set) into the block products' own order: per pair of rows and block,
  16-byte pieces of 8 code bytes of each row (4-bit: 2, 8-bit: 4), centred codes pre-flipped, so that an operand is
  one load (4-bit: and one nibble operation), as in llama.cpp's Q4_0 repacked at load time (4-bit pieces joined in
  every panel instead took 2 joins and 3 operations per 16 bytes). 4-bit rows in pairs (the neon_pairs order the
  decode GEMV reads) are rebuilt into each row's neon-order bytes as the re-lay reads them (neon_row_bytes: 3-4
  nibble operations per 16 bytes, once per task). Plain 8-bit W is read as it is, two 8-byte pieces joined.
- dotprod: `sdot` by element: the first operand holds 4 X rows x 4 values, the second one 32-bit lane of a W row
  (4 values) repeated; lane i sums row i's 4 products. 8 per block give a column of 4 outputs without horizontal
  sums. W re-laid per task is each row's blocks in the plain order, centred codes pre-flipped.
- Symmetric codes go in centred, c - offset, so that no activation-sum term is left: 8-bit codes as stored in the
  "neon" order (signed), else as c ^ 0x80; 4-bit codes as 16 (c - 8), the nibbles of b ^ 0x88 (flipped by the
  re-lay) shifted into (b << 4) or masked in place (b & 0xF0) as signed bytes, and the 16 taken out by the
  int-to-float convert (fixed point, 4 fraction bits). Asymmetric codes go in as they are (4-bit only: 0..15 are
  valid int8) and the min's term is added per block from the activation sums.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ...quantization.group import paired_position

# int_dot family (compiler/target/isa.py) -> X rows per 16-byte activation vector: smmla pairs, sdot fours
ROWS_PER_VECTOR = {"i8mm": 2, "dotprod": 4}
FAMILIES = tuple(ROWS_PER_VECTOR)
LANES = 4  # int32 lanes of a tile


def rows_per_vector(family: str) -> int:
    return ROWS_PER_VECTOR[family]


def columns_per_tile(family: str) -> int:
    """W rows a 4-lane tile covers: lane l is X row l // columns_per_tile and W row l % columns_per_tile."""
    return LANES // ROWS_PER_VECTOR[family]


def takes(shape) -> bool:
    """Asymmetric codes must be valid int8 as they are: 4-bit."""
    return shape.symmetric or shape.bits == 4


def centered(shape) -> bool:
    """Symmetric codes go in as c - offset (4-bit: times 16, see fraction_bits)."""
    return shape.symmetric


def fraction_bits(shape) -> int:
    """The block sums are 2^fraction_bits times the products of codes and activations (centred 4-bit codes: 16)."""
    return 4 if shape.symmetric and shape.bits == 4 else 0


def _operand(shape, packed, part):
    """Codes from 16 bytes of W: 4-bit (re-laid, symmetric ones pre-flipped) part 0 the low nibbles, 1 the high ones;
    8-bit the bytes (flipped here where plain and centred; re-laid ones are flipped already)."""
    if shape.bits == 8:
        return _flipped(shape, packed, 16) if shape.code_order == "plain" else packed
    if centered(shape):
        return (T.shift_left(packed, T.broadcast(T.uint8(4), 16)) if part == 0
                else T.bitwise_and(packed, T.broadcast(T.uint8(0xF0), 16)))
    return (T.bitwise_and(packed, T.broadcast(T.uint8(15), 16)) if part == 0
            else T.shift_right(packed, T.broadcast(T.uint8(4), 16)))


def _piece(shape, w, n, block, piece, count=1):
    """`count` consecutive 8-byte pieces of plain 8-bit block `block`'s code bytes in W row n, from piece `piece`."""
    return w[n, T.ramp(block * shape.bits * 4 + piece * 8, 1, 8 * count)]


def pieces(shape) -> int:
    """16-byte pieces per block of a tile's columns of W rows in the re-laid order: smmla's W operands (8 values of
    2 rows each), or the sdot rows' 16 bytes."""
    return shape.bits * columns_per_tile(shape.family) // 4


def set_bytes(bits: int) -> int:
    """Bytes of a set of 4 blocks of one row (the neon order's sets, quantization/group.py)."""
    return 16 * bits


def relaid_bytes(shape) -> int:
    """Bytes per W row of the re-laid codes: whole sets of 4 blocks (a shorter last set padded)."""
    return -(-shape.k // 128) * set_bytes(shape.bits)


def relaid_set(shape, sources):
    """64 re-laid bytes: piece h of each block of a set of 4 (16 bytes a block, block order; the rows' bytes 8 h ..
    8 h + 7 side by side for i8mm, the row's 16 h .. 16 h + 15 for dotprod), centred codes flipped, from the neon
    order's words 4 c + i (word c of block i) with c in the piece (`sources`: per row, its 64 / columns bytes of the
    set from byte 64 h / columns). Output word 4 i + j is a lane of the j-th of 4 loaded vectors: one `st4`."""
    per_row = 4 // len(sources)  # words of a block per row and piece
    # flipped before the shuffle: a store of the shuffle itself is what LLVM makes an st4 of
    words = [T.reinterpret(f"uint32x{4 * per_row}", _flipped(shape, source, 16 * per_row)) for source in sources]
    order = [j // per_row * 4 * per_row + 4 * (j % per_row) + i for i in range(4) for j in range(4)]
    return T.reinterpret("uint8x64", T.Shuffle(words, order))


def relaid_block(shape, sources):
    """16 re-laid bytes of a block past the last whole set (in place, plain, in the neon order): `sources`, per row
    its 16 / columns bytes of piece h, side by side."""
    joined = sources[0] if len(sources) == 1 else T.Shuffle(sources, list(range(16)))
    return _flipped(shape, joined, 16)


def _flipped(shape, codes, lanes: int):
    """Centred codes flipped so that they go in as signed bytes: 4-bit b ^ 0x88 (the nibbles then shift or mask into
    16 (c - 8), _operand), 8-bit c ^ 0x80 unless stored signed already."""
    if not centered(shape) or shape.signed_codes:
        return codes
    return T.bitwise_xor(codes, T.broadcast(T.uint8(0x88 if shape.bits == 4 else 0x80), lanes))


def neon_row_bytes(shape, w, row, start, count: int, odd: int):
    """`count` bytes of W row `row` in the neon order from byte `start` (whole 16-byte chunks, or a part of one):
    as stored, or rebuilt from the pairs' bytes (neon_pairs, quantization/group.py: per chunk of the pair, the low
    nibbles of both rows, then the high ones, the second row's ^ 8). `odd`: row % 2."""
    if shape.code_order != "neon_pairs":
        return w[row, T.ramp(start, 1, count)]
    row_bytes = shape.k // 2

    def rebuilt(at, width):  # a part of one chunk: its low and high nibbles' bytes in the pair's bytes
        low, high = [w[stored_row, T.ramp(column, 1, width)]
                     for stored_row, column in (paired_position(row - odd, at, h, row_bytes) for h in (0, 1))]
        if odd:  # the high nibbles, ^ 8 each
            joined = T.bitwise_or(T.shift_right(low, T.broadcast(T.uint8(4), width)),
                                  T.bitwise_and(high, T.broadcast(T.uint8(0xF0), width)))
            return T.bitwise_xor(joined, T.broadcast(T.uint8(0x88), width))
        return T.bitwise_or(T.bitwise_and(low, T.broadcast(T.uint8(15), width)),
                            T.shift_left(high, T.broadcast(T.uint8(4), width)))

    if count <= 16:
        return rebuilt(start, count)
    return T.Shuffle([rebuilt(start + c * 16, 16) for c in range(count // 16)], list(range(count)))


def relaid_start(shape, n, block, piece):
    """Where piece `piece` of block `block` of the W rows from n (a whole tile's columns) starts in the task's flat
    re-laid codes: per columns rows, sets of 4 blocks, pieces, blocks of 16 bytes."""
    # (block // 4 * pieces + piece) * 64 + block % 4 * 16, written so that a block costs one shift and add
    return n * relaid_bytes(shape) + block * 16 + (block // 4) * (64 * (pieces(shape) - 1)) + piece * 64


def _relaid_operand(shape, w, n, block, piece):
    """16 bytes of the re-laid codes (relaid_set) at relaid_start; w flat."""
    return w[T.ramp(relaid_start(shape, n, block, piece), 1, 16)]


def _codes(shape, w, n, block, half):
    """16 codes of W row n for block `block` (half 0: values 0-15, 1: 16-31)."""
    if shape.code_order == "plain":
        return _operand(shape, _piece(shape, w, n, block, half * 2, 2), 0)
    if shape.bits == 4:
        return _operand(shape, _relaid_operand(shape, w, n, block, 0), half)
    return _relaid_operand(shape, w, n, block, half)


def _pair_operand(shape, w, n, block, chunk):
    """W rows n, n + 1, values 8 chunk .. 8 chunk + 7 of the block, row n in bytes 0-7: smmla's second operand."""
    if shape.code_order == "plain":
        return _operand(shape, T.Shuffle([_piece(shape, w, n + r, block, chunk) for r in (0, 1)], list(range(16))), 0)
    if shape.bits == 4:  # chunks 0, 1: the low nibbles of the re-laid pieces 0, 1; 2, 3 their high ones
        return _operand(shape, _relaid_operand(shape, w, n, block, chunk % 2), chunk // 2)
    return _relaid_operand(shape, w, n, block, chunk)


def _lane(codes, index: int):
    """32-bit lane `index` of 16 code bytes repeated 4 times, as int8x16 (LLVM folds it into sdot's element form)."""
    return T.reinterpret("int8x16", T.Shuffle([T.reinterpret("int32x4", codes)], [index] * 4))


def block_dot(shape, w, xq, n, block, x_vector):
    """int32x4: the tile of W rows from n (columns_per_tile of them) times the X rows of activation vectors
    `x_vector(chunk)` (16 bytes; chunk: 8 values per vector with i8mm, 4 with dotprod) over block `block`."""
    acc = T.broadcast(T.int32(0), LANES)
    if shape.family == "i8mm":
        for chunk in range(4):
            acc = T.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.smmla.v4i32.v16i8", acc,
                                          xq[x_vector(block * 4 + chunk)],
                                          T.reinterpret("int8x16", _pair_operand(shape, w, n, block, chunk)))
        return acc
    for half in (0, 1):
        codes = _codes(shape, w, n, block, half)
        for index in range(4):
            acc = T.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.sdot.v4i32.v16i8", acc,
                                          xq[x_vector(block * 8 + half * 4 + index)], _lane(codes, index))
    return acc


def to_float(shape, ints):
    """float32x4 of a tile's block sums, divided by 2^fraction_bits in the convert itself (scvtf's fixed-point form)."""
    if fraction_bits(shape) == 0:
        return T.Cast("float32x4", ints)
    return T.call_llvm_pure_intrin("float32x4", "llvm.aarch64.neon.vcvtfxs2fp.v4f32.v4i32", ints,
                                   T.int32(fraction_bits(shape)))
