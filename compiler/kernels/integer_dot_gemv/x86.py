"""x86 variants of the integer decode GEMV's step: a vector of code bytes times their activations into int32 lanes, per
integer dot-product family of compiler/target/isa.py, and the order the activation kernel stores activations in so that
each instruction reads them contiguously. The algorithm around it (compiler/kernels/integer_dot_gemv) is the same
for every family.

- int16 activations: `vpmaddwd` (pairs of int16 products summed into int32). Codes are widened without shuffles:
  the code bytes read as int16 words, each word's four 4-bit codes (or two 8-bit ones) taken out by shift and mask
  (ymm: 32 bytes, 16 words; zmm: 64 bytes, 32 words, _zmm_words); only AVX-512 8-bit codes of an odd number of
  blocks or in 16-value groups go in 32 at a time widened by `vpmovzxbw`. `vpmovzxbw` ymm crosses 128-bit lanes
  and took 12 of the 22 cycles per 64 codes on Zen 3's two shuffle pipes (llvm-mca); the in-lane `vpunpck[lh]bw`
  that replaced it still took 4 shuffles per step. A word of a 4-bit step holds two codes of one block, so the two
  blocks of a ymm step stay in lanes 0-3 and 4-7 of one int32x8 and a step also needs half the float work of two
  int32x8 halves; 8-bit steps take two blocks the same way, from half-vector loads (_paired_8_bit).
- int8 activations: `vpdpbusd` (4 uint8 x int8 products summed into each int32 lane) with AVX-512 VNNI (EVEX) or
  AVX-VNNI (VEX); else `vpmaddubsw` + `vpmaddwd` by ones (AVX2).
"""

from __future__ import annotations

from tvm.script import tirx as T

STEP_BYTES = 32  # one ymm of code bytes per step
MINS_PER_STEP = False  # asymmetric codes: the mins' term once per row, a dot with the per-group activation sums
# 8-bit codes: lanes 0 .. lanes/2 - 1 of a step sum its codes 0-15 (vpmaddwd after word or in-order widening,
# vpdpbusd), so 16-value groups (GGUF Q6_K) take a scale per half of the lanes
HALF_BLOCK_GROUPS = True
CODE_ORDER = "plain"  # the weights stay in K order (quantization/group.CODE_ORDERS)
reduce_rows = None  # each row's lanes summed on their own
paired_tail_dot = None  # a shorter last step (zmm words) is each row's own
pair_step_dot = None  # rows stay apart (CODE_ORDER)
second_of_pair_float = None
FMA_CHAINS = False  # LLVM fuses the a * b + c of a step as it is
# int_dot family -> whether its int8 steps have vpdpbusd
FAMILIES = {"avx512vnni": True, "avx512bw": False, "avxvnni": True, "avx2": False}
# batch_decode's activation rows per tile (integer_dot_gemv.gemv): their accumulators and the shared widened codes
# fit the registers
ACTIVATION_ROW_TILE = 4
_ZMM_MADD = ("avx512vnni", "avx512bw")


def rows_together(shape) -> int:
    return 1  # a row at a time: its step's activations come from L1 and the loads overlap the madds


def chains(shape) -> int:
    """Float accumulators per row that consecutive steps add into in turn. With one, each step's FMA waits on the
    last (4 cycles on Zen 3/4): the ymm steps are short enough for that to bound them (the AVX2 8-bit lm_head, 1
    thread, Zen 4: 1.80 -> 1.40 ms); the zmm int16 steps are not (llvm-mca: 10% more cycles with two)."""
    return 2 if int32_lanes(shape) == 8 else 1


def blocks_per_step(shape) -> int:
    if _zmm_words(shape):
        return 4 if shape.bits == 4 else 2
    return 2 if _paired_8_bit(shape) else STEP_BYTES * 8 // shape.bits // 32


def tail_steps(shape) -> bool:
    """Whether a K that leaves blocks past the whole steps ends in a shorter step: the 2 blocks after the 4-block
    steps of zmm words, taken as one ymm word step. Else K must be whole steps."""
    return _zmm_words(shape) and shape.tail_blocks == 2


def _zmm_words(shape) -> bool:
    """int16 activations, AVX-512BW: a step is 64 code bytes read as 32 int16 words (no vpmovzxbw, which widened 32
    codes a step): 4-bit codes, 4 blocks, each in 4 of the 16 int32 lanes, one step of float work per 128 codes
    instead of per 64; 8-bit codes (an even number of blocks, not in 16-value groups), 2 blocks in 8 lanes each,
    one per 64 codes instead of per 32. 1536 rows in cache, one Zen 4 core, ns per 32-weight block: 4-bit K = 1536
    0.95 -> 0.68, K = 576 (4 steps and a ymm step of 2 blocks) 0.98 -> 0.83 (two float accumulators, chains, helped
    K = 576: 0.79, and hurt K = 1536: 0.75); 8-bit K = 576 (SmolLM2's lm_head) 1.29 -> 0.87."""
    if shape.act_bits != 16 or shape.family not in _ZMM_MADD:
        return False
    return shape.bits == 4 or _two_8_bit_blocks(shape)


def _two_8_bit_blocks(shape) -> bool:
    """8-bit codes a word step can take two blocks at a time: an even number of blocks, not in 16-value groups."""
    return shape.bits == 8 and not shape.half_block_groups and shape.k // 32 % 2 == 0


def _paired_8_bit(shape) -> bool:
    """8-bit codes, AVX2 int16: a step takes two blocks, [A 0-15 | B 0-15] and [A 16-31 | B 16-31] as two ymm (each
    a 16-byte load and an insert), so that lanes 0-3 sum block A and 4-7 block B, as in a 4-bit step: one step of
    float work (a convert, two FMAs, the scales widened) per 64 codes instead of per 32. SmolLM2's Q8_0 lm_head shape
    (K = 576), 1024 rows in cache, one Zen 4 core running the AVX2 code: 22.0 -> 20.6 us; llvm-mca-19, the code built
    for each core, cycles per 32 weights: znver1 6.18 -> 5.88, znver2 5.71 -> 4.96, skylake 4.23 -> 3.40. Needs an
    even number of blocks; 16-value groups keep a block a step."""
    return _word_int16(shape) and _two_8_bit_blocks(shape)


def qmax(shape) -> int:
    return (1 << (shape.act_bits - 1)) - 1


def centered(shape) -> bool:
    """8-bit codes on AVX2's int8 path go in as c - 128: c * q pair sums would overflow vpmaddubsw's int16."""
    return shape.act_bits == 8 and shape.bits == 8 and not FAMILIES[shape.family]


def split_int16(shape) -> bool:
    return False  # vpmaddwd takes int16 activations as they are


def _word_int16(shape) -> bool:
    return shape.act_bits == 16 and shape.family not in _ZMM_MADD


def int32_lanes(shape) -> int:
    """32 int16 products summed by pairs (16 lanes; 8 when the word widening folds the two halves of a step into
    one ymm), or 32 int8 products summed by fours (8 lanes)."""
    if shape.act_bits == 8 or _word_int16(shape):
        return 8
    return 16  # zmm int16


def activation_index(shape, b, j):
    """Where the activation of code j (0..31) of 32-value block b goes in xq."""
    if _word_int16(shape) or _zmm_words(shape):
        if shape.bits == 4:
            # per step (blocks B i .. B i + B - 1, B = 2 for ymm words, 4 for zmm): 4 vectors of 8 B
            # (_words_int16: low nibbles of even bytes, high of even, low of odd, high of odd), word k of block
            # B i + c in lane 8 c + k; byte j of a block holds codes j (low nibble) and j + 16 (high). The shorter
            # last step of zmm words is a ymm step (B = 2) after the whole ones.
            nibble = j // 16 + j % 16 % 2 * 2
            per_step = shape.blocks_per_step
            index = b // per_step * 32 * per_step + nibble * 8 * per_step + b % per_step * 8 + j % 16 // 2
            if per_step == 4 and shape.tail_blocks > 0:
                tail = shape.steps * 128 + nibble * 16 + b % 2 * 8 + j % 16 // 2
                index = T.Select(b < shape.steps * 4, index, tail)
            return index
        if _zmm_words(shape):
            # per step (blocks 2i, 2i+1): 2 vectors of 32 (_words_int16: low bytes, high bytes), word k of block
            # 2i in lane k, of block 2i+1 in lane 16 + k
            return b // 2 * 64 + j % 2 * 32 + b % 2 * 16 + j // 2
        if _paired_8_bit(shape):
            # per step (blocks 2i, 2i+1): 4 vectors of 16 (_paired_8_bit's two ymm, each as _words_int16's low bytes
            # then high bytes), word k of block 2i in lane k, of block 2i+1 in lane 8 + k; codes 0-15 in the first ymm
            return b // 2 * 64 + (j // 16 * 2 + j % 2) * 16 + b % 2 * 8 + j % 16 // 2
        # per block: even codes, then odd codes (_words_int16: low bytes, then high bytes of the 16 words)
        return b * 32 + j % 2 * 16 + j // 2
    if shape.bits == 4:
        # low nibbles of blocks 2i and 2i+1 (codes 0..15 of each), then their high nibbles (16..31)
        return b // 2 * 64 + j // 16 * 32 + b % 2 * 16 + j % 16
    return b * 32 + j


def _words_int16(codes, size: int, bits: int):
    """`size` code bytes (uint8 x size) -> their size / 2 int16 words' 4-bit (or 8-bit) fields, low to high, each
    zero-extended to int16 x (size / 2): shifts and masks only, which any vector ALU pipe issues (no shuffle)."""
    count = size // 2
    words = T.reinterpret(f"uint16x{count}", codes)
    fields = []
    for shift in range(0, 16, bits):
        field = T.shift_right(words, T.broadcast(T.uint16(shift), count)) if shift else words
        if shift + bits < 16:  # the top field needs no mask: the logical shift brought in zeros
            field = T.bitwise_and(field, T.broadcast(T.uint16((1 << bits) - 1), count))
        fields.append(T.reinterpret(f"int16x{count}", field))
    return fields


def _word_dots(codes, size: int, bits: int, xq, base):
    """The int32 lanes (ymm: 8, zmm: 16) of `size` code bytes read as words (_words_int16), field v dotted by
    `vpmaddwd` with the activations from base + v x (words per vector)."""
    fields = _words_int16(codes, size, bits)
    count = size // 2
    intrinsic = "llvm.x86.avx2.pmadd.wd" if count == 16 else "llvm.x86.avx512.pmaddw.d.512"
    acc = T.broadcast(T.int32(0), count // 2)
    for v, field in enumerate(fields):
        acc = acc + T.call_llvm_pure_intrin(f"int32x{count // 2}", intrinsic, field, xq[T.ramp(base + v * count, 1,
                                                                                                count)])
    return acc


def _dot(shape, acc, codes, act):
    """acc + the sums of products of 32 codes and 32 activations (zmm int16, or ymm int8)."""
    if shape.act_bits == 16:
        return acc + T.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.pmaddw.d.512", codes, act)
    if FAMILIES[shape.family]:
        return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx512.vpdpbusd.256", acc, codes, act)
    if shape.centered:
        # vpmaddubsw sums pairs into int16: 255 * 127 * 2 overflows, so 8-bit codes go in as c - 128, with |c - 128|
        # as the unsigned operand (-128 reads as 128) and q carrying its sign (|q| <= 127, no overflow); the
        # algorithm then leaves out the -128 * sum q term (GemvShape.centered).
        flipped = T.bitwise_xor(codes, T.broadcast(T.uint8(128), STEP_BYTES))
        codes = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", flipped, flipped)
        act = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", act, flipped)
    pairs = T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", codes, act)
    return acc + T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, T.broadcast(T.int16(1), 16))


def step_dot(shape, w, xq, n, step, blocks: int | None = None):
    """The int32 lanes of step `step` of row n: its code bytes times their activations (`blocks`: the shorter last
    step of zmm words, 2 blocks as a ymm word step in lanes 0-7)."""
    zero = T.broadcast(T.int32(0), shape.lanes)
    codes = w[n, T.ramp(step * STEP_BYTES, 1, STEP_BYTES)]
    if _zmm_words(shape):
        if blocks is None:
            return _word_dots(w[n, T.ramp(step * 2 * STEP_BYTES, 1, 2 * STEP_BYTES)], 2 * STEP_BYTES, shape.bits, xq,
                              step * 2 * STEP_BYTES * 8 // shape.bits)
        return T.Shuffle([_word_dots(w[n, T.ramp(step * 2 * STEP_BYTES, 1, STEP_BYTES)], STEP_BYTES, 4, xq, step * 128),
                          T.broadcast(T.int32(0), 8)], list(range(16)))
    if _paired_8_bit(shape):
        acc, start = zero, step * 2 * STEP_BYTES
        for half in range(2):
            halves = [w[n, T.ramp(start + block * STEP_BYTES + half * 16, 1, 16)] for block in range(2)]
            acc = acc + _word_dots(T.Shuffle(halves, list(range(STEP_BYTES))), STEP_BYTES, 8, xq, step * 64 + half * 32)
        return acc
    if _word_int16(shape):
        return _word_dots(codes, STEP_BYTES, shape.bits, xq, step * STEP_BYTES * 8 // shape.bits)
    if shape.act_bits == 16:
        # AVX-512 8-bit codes that no word step takes (an odd number of blocks, 16-value groups): widened by one
        # vpmovzxbw from memory
        return _dot(shape, zero, T.Cast("int16x32", codes), xq[T.ramp(step * STEP_BYTES, 1, STEP_BYTES)])
    if shape.bits == 8:
        return _dot(shape, zero, codes, xq[T.ramp(step * STEP_BYTES, 1, STEP_BYTES)])
    low = T.bitwise_and(codes, T.broadcast(T.uint8(15), STEP_BYTES))
    high = T.shift_right(codes, T.broadcast(T.uint8(4), STEP_BYTES))
    act_low, act_high = xq[T.ramp(step * 64, 1, STEP_BYTES)], xq[T.ramp(step * 64 + STEP_BYTES, 1, STEP_BYTES)]
    if shape.act_bits == 8 and not FAMILIES[shape.family]:
        # The low and high nibbles' int16 pair sums go in the same lanes (same block): added as int16 (4 products
        # of 15 * 127 at most, no overflow), they need one vpmaddwd by ones instead of two. vpmaddubsw and vpmaddwd
        # share one pipe on Zen 1/2 (FP0): 6 instead of 8 of its uops per 64 codes.
        pairs = (T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", low, act_low)
                 + T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", high, act_high))
        return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, T.broadcast(T.int16(1), 16))
    return _dot(shape, _dot(shape, zero, low, act_low), high, act_high)
