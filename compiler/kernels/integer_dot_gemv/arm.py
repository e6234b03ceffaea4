"""aarch64 variants of the integer decode GEMV's step: 4 blocks of 32 codes times their activations into 4 int32
lanes, one per block, with NEON's int8 dot products (compiler/target/isa.py families "dotprod" and "i8mm"). The
algorithm around it (compiler/kernels/integer_dot_gemv) is the one x86 uses; this file says how a step is computed, in
which order the activation kernel stores activations, and how many rows step together.

- A whole 4-bit step (4 blocks, 64 bytes of codes) is 4 vectors each holding 4 code bytes of every block, block i
  in lane i, so after AND 0x0F (low nibbles) and a shift by 4 (high nibbles) every `sdot` (16 int8 products summed
  by fours into 4 int32 lanes) adds 4 products of each block to its own lane: the step's 8 `sdot`s go into one
  accumulator, a lane per block. The activation kernel stores the activations in that order. ARM targets store
  4-bit codes in the "neon" order (quantization/group.py), whose steps are those 4 vectors as they are: 4 plain
  loads. Plain 4-bit codes (the GGUF block layout) are read by one `ld4` of 32-bit words that de-interleaves them,
  whose 4 vector-pipe cycles per step and row made it the costliest instruction of the loop (llvm-mca Neoverse-N2,
  SmolLM2 Q4_1 gate_up: 3.76 cycles per 32 weights with `ld4`, 3.26 with the neon order's loads).
- 4-bit rows in pairs (the neon_pairs order, what ARM targets store for an even number of rows): each 16-byte load
  holds 16 codes of each of two rows at the same activations, the first row's in the low nibbles and the second's
  ^ 8 in the high ones, so that the byte as int8 is c + 16 (c' - 8): one `sdot` of the raw bytes and one of their
  low nibbles (AND 0x0F) give the first row's sums and, by their difference, 16 times the second row's sums of
  (c' - 8), which a fixed-point `scvtf` (4 fraction bits) converts; the 8 joins the second row's min (asymmetric
  codes) or is the offset itself (symmetric). Per 32 codes an AND and 2 `sdot`s instead of an AND, a shift and 2
  `sdot`s (pair_step_dot; llvm-mca Neoverse-N2, SmolLM2 Q4_1 gate_up: 3.26 -> 2.86 cycles per 32 weights).
- 8-bit codes in the neon order are the same sets of 4 blocks interleaved by 4 bytes: a step is 8 plain loads whose
  `sdot`s all go into one accumulator, a lane per block (before, pairs of blocks interleaved by 8 bytes took two
  accumulators and an `addp` per step: SmolLM2's Q8_0 lm_head 2.13 -> 1.88 cycles per 32 weights on the
  Neoverse-N2 model, with its codes stored signed, below).
- Other steps (a shorter last step, plain 8-bit codes, 8-bit codes with a scale per 16 values): a block's two
  16-code vectors (a 16-byte load split into nibbles, or two loads) and two `sdot`s give its sum in 4 lanes; `addp`
  of `addp`s folds them into one int32x4. 8-bit codes with a scale per 16 values (GGUF Q6_K, 6-bit codes about 32;
  kept in the plain order) step one block at a time: one `addp` of its halves' `sdot`s puts
  each half's sum in 2 lanes, which take that half's scale.
- The float work of a step (convert, scale by activation and weight scales, accumulate; for asymmetric codes also
  the 4 mins times the blocks' activation sums) is 4-6 instructions per 128 codes, and a step's 4 weight scales are
  one 8-byte load and `fcvtl`, in lane order. A K that is not a multiple of 128 ends in a shorter step (SmolLM2's
  576: 4 steps and 2 blocks), its lanes past the last block zero. 2 or 4 rows step together (rows_together) and
  share the step's activation loads; their sums are `faddp`s. Two rows' shorter last steps of 2 blocks fill one
  vector (paired_tail_dot), whose float step adds to the pair's first `faddp`: one convert and one step of float
  work per pair of rows instead of per row (llvm-mca Neoverse-N2, SmolLM2 Q4_1 at K = 576, whole row: 3.80 -> 3.49
  cycles per 32 weights, with FMA_CHAINS).
- 4-bit codes 0..15 are valid int8: `sdot` takes them unsigned, and the -8 offset of symmetric codes is the
  activation sum term (as on x86), so no per-code subtraction as in llama.cpp's Q4_0 kernel.
- 8-bit codes about 128 (GGUF Q8_0, our q8 schemes) are stored signed (c - 128), which `sdot` takes as they are:
  the offset term drops out. Other 8-bit codes (GGUF Q5_K's asymmetric ones): with i8mm, `usdot` (unsigned codes x
  signed activations) takes them as they are; with dotprod alone they go in as c - 128 (one EOR per 16 codes,
  GemvShape.centered) and take 128 scales into each step's mins (c d + m = (c - 128) d + 128 d + m).
- int16 activations (float-accurate; the ARM target files default to int8): q = 256 h + l with l and h int8
  (|q| <= 32639 so that h fits), stored as two byte planes; each block is `sdot`ed with h, shifted left by 8 and
  `sdot`ed with l: 4 dot products per 32 codes instead of 2, no widening (llvm-mca Neoverse-N2: ~1.5x the int8
  cycles).

Modelled by bench/arm_gemv_mca.py (llvm-mca-15, SmolLM2 shapes, steady-state loop, both built for the same -mcpu).
Not done: `smmla`/`usmmla` (i8mm) multiply a 2x8 by an 8x2 block: with one activation row (decode) half of each
product is wasted, and both models issue them at `sdot`'s rate, so i8mm targets use `sdot` here too.
"""

from __future__ import annotations

from tvm.script import tirx as T

BLOCKS_PER_STEP = 4  # one int32x4 of block sums per step
LANES = 4
MINS_PER_STEP = True  # asymmetric codes: the step's 4 mins times the 4 blocks' activation sums, one FMA
HALF_BLOCK_GROUPS = True  # 8-bit codes in groups of 16 (GGUF Q6_K): a block per step, 2 lanes per half
# sets of 4 blocks interleaved by 4 bytes, 4-bit rows in pairs a nibble each, 8-bit codes about 128 signed (an odd
# number of rows, or 8-bit codes: the neon order; group.CODE_ORDERS, FALLBACK)
CODE_ORDER = "neon_pairs"
# Each step's float work as explicit FMAs: a wholly unrolled row (K = 576) was otherwise reassociated by LLVM into
# separate products and adds (llvm-mca Neoverse-N2, SmolLM2 Q4_1: 3.61 -> 3.53 cycles per 32 weights)
FMA_CHAINS = True


# int_dot family -> whether it has an unsigned x signed int8 dot product (usdot)
FAMILIES = {"i8mm": True, "dotprod": False}
# batch_decode's activation rows per tile (integer_dot_gemv.gemv): rows_together weight rows x 4 activation rows
# spilled 56-82 q registers per loop (i8mm, SmolLM2 shapes)
ACTIVATION_ROW_TILE = 2
# int16 activations as two int8 planes: |q| <= 127 * 256 + 127, so that q = 256 h + l with h, l in -128..127
INT16_QMAX = 32639


def tail_steps(shape) -> bool:
    return True  # a K of whole blocks that are not a multiple of a step ends in a shorter step


def rows_together(shape) -> int:
    """Rows that step together, sharing the step's activation loads (128 bytes). 4, except asymmetric 4-bit codes:
    their interleaved step (8 code vectors) and its mins' term leave too few registers for 4 rows (llvm-mca
    Neoverse-N2, SmolLM2 Q4_1 gate_up: 4.41 cycles per 32 weights with 4, 3.77 with 2; Q4_0 4.04 with 4, 4.42 with
    2, where LLVM unrolls the 4.5 steps and keeps all their activations live; the Q8_0 lm_head, then in pairs of
    blocks, 2.95 with 1, 2.56 with 2, 2.13 with 4). Rows in pairs (neon_pairs) split each code vector once for two
    rows: asymmetric ones with int8 activations step by 4 rows too (3.20 -> 3.04 cycles per 32 weights at K = 576,
    2.89 -> 2.84 at 1536), with int16 ones (two planes) by 2 (4.15 with 2, 5.03 with 4 at K = 1536)."""
    if shape.bits == 4 and not shape.symmetric:
        return 4 if shape.row_pairs and shape.act_bits == 8 else 2
    return 4


def chains(shape) -> int:
    return 1  # rows_together rows step together: their accumulators are already independent


def blocks_per_step(shape) -> int:
    return 1 if shape.half_block_groups else BLOCKS_PER_STEP


def int32_lanes(shape) -> int:
    return LANES


def qmax(shape) -> int:
    return INT16_QMAX if shape.act_bits == 16 else 127


def centered(shape) -> bool:
    """8-bit codes go into `sdot` as c - 128: stored so (signed_codes), or flipped where there is no usdot."""
    return shape.bits == 8 and (shape.signed_codes or not FAMILIES[shape.family])


def split_int16(shape) -> bool:
    """int16 activations are stored as a plane of low bytes and one of high bytes (activation_index's plane)."""
    return shape.act_bits == 16


def activation_index(shape, b, j, plane: int = 0):
    """Where the activation of code j (0..31) of block b goes. A whole step in the neon order (_step_codes), per
    16-value vector of the step, 4 values of each of its 4 blocks in block order: 4-bit codes, vector
    v = 2 (j % 16 // 4) + j // 16 (a byte's low and high nibbles are codes j and j + 16); 8-bit codes, v = j // 4.
    Otherwise natural order (a block's 16-byte halves meet its low and high nibbles, or its two 16-code vectors).
    int8 stores the values; for int16, the index in the byte view of xq of the low byte (plane 0) or high byte
    (plane 1): per 16 values, 16 low bytes then 16 high bytes."""
    position = b * 32 + j
    # b: the activation kernel's loop variable, so the choice of order is a select
    if _interleaved_steps(shape):
        vector = j % 16 // 4 * 2 + j // 16 if shape.bits == 4 else j // 4
        interleaved = b // BLOCKS_PER_STEP * 128 + vector * 16 + b % BLOCKS_PER_STEP * 4 + j % 4
        position = T.Select(b < shape.steps * BLOCKS_PER_STEP, interleaved, position)
    if shape.act_bits == 8:
        return position
    return position // 16 * 32 + plane * 16 + position % 16


def _interleaved_steps(shape) -> bool:
    """Whole steps read as sets of 4 blocks interleaved by 4 bytes (_step_codes): 4-bit codes in either order (the
    plain one de-interleaved by ld4), 8-bit ones in the neon order (16-value groups stay plain)."""
    return shape.bits == 4 or (shape.code_order == "neon" and not shape.half_block_groups)


def _dot(shape, acc, codes, act):
    """acc + per int32 lane the sum of 4 products of 16 code bytes (uint8) and 16 int8 activations."""
    if shape.bits == 8 and not shape.centered:
        return T.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.usdot.v4i32.v16i8", acc, codes, act)
    return T.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.sdot.v4i32.v16i8", acc,
                                   T.reinterpret("int8x16", codes), act)


def _code_vectors(shape, w, n, start, count):
    """The code vectors of `count` 16-byte loads from byte `start` of row n: 4-bit, each load's low then high
    nibbles; 8-bit, the loads (flipped to c - 128 where centred but stored unsigned)."""
    parts = []
    for i in range(count):
        codes = w[n, T.ramp(start + i * 16, 1, 16)]
        if shape.bits == 4:
            parts += _nibbles(codes)
        elif shape.centered and not shape.signed_codes:
            parts.append(T.bitwise_xor(codes, T.broadcast(T.uint8(128), 16)))
        else:
            parts.append(codes)
    return parts


def _block_codes(shape, w, n, block):
    """The two 16-code vectors of a block (plain order), each matched by 16 consecutive activations."""
    return _code_vectors(shape, w, n, block * shape.bits * 4, 1 if shape.bits == 4 else 2)


def _dot_vectors(shape, parts, xq, first):
    """int32x4: each 16-code vector of `parts` dotted with its 16 activations, vector v being the activations'
    16-value vector first + v (int8: values; int16: its 16 low bytes then 16 high bytes in the byte view)."""
    zero = T.broadcast(T.int32(0), LANES)
    if shape.act_bits == 8:
        acc = zero
        for v, codes in enumerate(parts):
            acc = _dot(shape, acc, codes, xq[T.ramp((first + v) * 16, 1, 16)])
        return acc
    high = zero
    for v, codes in enumerate(parts):
        high = _dot(shape, high, codes, xq[T.ramp((first + v) * 32 + 16, 1, 16)])
    acc = T.shift_left(high, T.broadcast(T.int32(8), LANES))
    for v, codes in enumerate(parts):
        acc = _dot(shape, acc, codes, xq[T.ramp((first + v) * 32, 1, 16)])
    return acc


def _block_dot(shape, w, xq, n, block):
    """int32x4 whose lanes add up to the block's sum of codes times activations (a block stored in plain order)."""
    return _dot_vectors(shape, _block_codes(shape, w, n, block), xq, block * 2)


def _addp(a, b):
    """Pairwise add: [a0 + a1, a2 + a3, b0 + b1, b2 + b3]."""
    return T.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.addp.v4i32", a, b)


def _step_codes(shape, w, n, step):
    """The 4 blocks of a whole step as vectors of 16 codes, 4 of each block in block order: the neon order's plain
    loads (4-bit: 4, each split into low and high nibbles; 8-bit: 8), or a plain 4-bit step's 64 bytes read as 16
    words and de-interleaved by 4 (one `ld4`)."""
    if shape.bits == 8:
        return _code_vectors(shape, w, n, step * 128, 8)
    if shape.code_order == "neon":
        vectors = [w[n, T.ramp(step * 64 + c * 16, 1, 16)] for c in range(4)]
    else:
        words = T.reinterpret("uint32x16", w[n, T.ramp(step * 64, 1, 64)])
        vectors = [T.reinterpret("uint8x16", T.Shuffle([words], [c, c + 4, c + 8, c + 12])) for c in range(4)]
    return [part for codes in vectors for part in _nibbles(codes)]


def _low_nibbles(codes):
    return T.bitwise_and(codes, T.broadcast(T.uint8(15), 16))


def _nibbles(codes):
    """16 code bytes -> their low nibbles and their high ones (4-bit codes j and j + 16)."""
    return [_low_nibbles(codes), T.shift_right(codes, T.broadcast(T.uint8(4), 16))]


def step_dot(shape, w, xq, n, step, blocks: int = BLOCKS_PER_STEP):
    """Lane i: the sum of codes times activations of block step * 4 + i (zero past `blocks`, a shorter last step).
    For int16 activations xq is the byte view of the activation planes."""
    if shape.half_block_groups:  # lanes 0-1: the block's first 16 codes, 2-3: its last 16
        halves = [_dot_vectors(shape, [codes], xq, step * 2 + h) for h, codes in enumerate(_block_codes(shape, w, n,
                                                                                                          step))]
        return _addp(halves[0], halves[1])
    if blocks == BLOCKS_PER_STEP and _interleaved_steps(shape):
        # lane i: block step * 4 + i, each sdot adding to every lane
        return _dot_vectors(shape, _step_codes(shape, w, n, step), xq, step * 8)
    # the whole steps of plain 8-bit codes, or the shorter last step after `step` whole ones
    return _lane_per_block([_block_dot(shape, w, xq, n, step * BLOCKS_PER_STEP + i) for i in range(blocks)])


def _lane_per_block(sums):
    """Up to 4 blocks' int32x4 whose lanes add up to each block's sum -> lane i: block i's sum (zero past the
    blocks): two blocks' lanes folded by one addp, then two of those."""
    zero = T.broadcast(T.int32(0), LANES)
    two = [_addp(sums[i], sums[i + 1] if i + 1 < len(sums) else zero) for i in range(0, len(sums), 2)]
    return _addp(two[0], two[1] if len(two) > 1 else zero)


def paired_tail_dot(shape, w, xq, n, step):
    """Lanes 0-1: the 2 blocks of the shorter last step (after `step` whole ones) of row n, 2-3: those of row n + 1
    (rows in pairs: w is the pairs' view, and lanes 2-3 hold the sums of c - 8, the shift exact)."""
    first = step * BLOCKS_PER_STEP
    if shape.row_pairs:
        low, high = _pair_blocks(shape, w, xq, n // 2, first, 2)
        return _addp(_addp(low[0], low[1]), T.shift_right(_addp(high[0], high[1]), T.broadcast(T.int32(4), LANES)))
    rows = [[_block_dot(shape, w, xq, row, first + i) for i in (0, 1)] for row in (n, n + 1)]
    return _addp(_addp(*rows[0]), _addp(*rows[1]))


def pair_step_dot(shape, w, xq, pair, step, blocks: int = BLOCKS_PER_STEP):
    """Rows 2 pair and 2 pair + 1 in the neon_pairs order (w: the pairs' view, a pair's bytes per row): step_dot's
    lanes of the first row, and 16 times those of the second taken as c - 8. Each 16 bytes hold both rows' codes at
    the same activations, c + 16 (c' - 8) as a signed byte: one `sdot` of the bytes and one of their low nibbles
    (the first row's codes); their difference is the second row's."""
    if blocks == BLOCKS_PER_STEP:
        # the step's 8 chunks of 16 bytes: code vector v of both rows (_step_codes' order), 128 bytes
        return _pair_dots(shape, [w[pair, T.ramp(step * 128 + v * 16, 1, 16)] for v in range(8)], xq, step * 8)
    low, high = _pair_blocks(shape, w, xq, pair, step * BLOCKS_PER_STEP, blocks)
    return _lane_per_block(low), _lane_per_block(high)


def _pair_dots(shape, chunks, xq, first):
    """The first row's int32x4 of 16-byte chunks of a pair (activation vectors from `first`: _dot_vectors), and 16
    times the second row's (c - 8): the raw bytes' dot products less the low nibbles'."""
    low = _dot_vectors(shape, [_low_nibbles(codes) for codes in chunks], xq, first)
    return low, _dot_vectors(shape, chunks, xq, first) - low


def second_of_pair_float(ints):
    """float32x4 of pair_step_dot's second-row lanes, 16 (c - 8) q sums, divided by 16 in the convert itself (scvtf's
    fixed-point form, 4 fraction bits)."""
    return T.call_llvm_pure_intrin("float32x4", "llvm.aarch64.neon.vcvtfxs2fp.v4f32.v4i32", ints, T.int32(4))


def _pair_blocks(shape, w, xq, pair, first, count):
    """Per block from `first` (past the last whole step, in place: its two 16-byte chunks of both rows' codes 0-15
    and 16-31, at their activations in natural order), the int32x4 whose lanes add up to the first row's sum and
    to 16 times the second row's (c - 8)."""
    sums = [_pair_dots(shape, [w[pair, T.ramp(block * 32 + h * 16, 1, 16)] for h in (0, 1)], xq, block * 2)
            for block in range(first, first + count)]
    return [low for low, _ in sums], [high for _, high in sums]


def _faddp(a, b):
    """Pairwise float add: [a0 + a1, a2 + a3, b0 + b1, b2 + b3]."""
    return T.call_llvm_pure_intrin("float32x4", "llvm.aarch64.neon.faddp.v4f32", a, b)


def reduce_rows(shape, accs, tails=()):
    """The lane sums of 2 or 4 rows' float32x4 accumulators as one vector (faddp of faddps: 3 instructions for 4
    rows, where a sum across lanes per row takes 2 and a store each). `tails`: per pair of rows, acc -> acc plus
    their shorter last step, applied to the pair's first faddp (whose lanes 0-1 hold row 2 p's partial sums, 2-3 row
    2 p + 1's, as the tail's lanes do)."""
    pairs = [_faddp(accs[i], accs[i + 1]) for i in range(0, len(accs), 2)]
    pairs = [tails[p](pair) if tails else pair for p, pair in enumerate(pairs)]
    if len(pairs) == 2:
        return _faddp(pairs[0], pairs[1])
    return T.Shuffle([_faddp(pairs[0], pairs[0])], [0, 1])
