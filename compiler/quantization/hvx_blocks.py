"""Group-quantized weights re-laid once, at compile time, for the HVX GEMV and GEMM (native/hexagon/hvx_gemv.c).

Any layout of 4- or 8-bit codes in groups of a multiple of 32 along K, with float16 or float32 scales (GGUF Q4_0,
Q4_1, Q8_0, Q4_K, Q5_K as gguf_blocks keeps them, our symmetric and asymmetric g32 and g128 schemes), or of 8-bit
codes in groups of 16 (GGUF Q6_K; a Q4_K_M file's q/k/v joined with a Q6_K v), becomes tiles of 32 rows, one row
per 32-bit vector lane, each tile a run of records of two 32-value blocks (K is zero-padded to whole pairs). A
group of 64, 128, ... has its scale (and min) repeated for each of its 32-value blocks: the same values, so the
kernel is g32's. Groups of 16 ("halves") keep a scale per 16 values: two scale vectors, one per block:

    record = [scales] [mins, asymmetric only] [codes of block 0] [codes of block 1]       (128-byte vectors)
    scales: word i = D(row i, block 1) << 16 | D(row i, block 0)    (int16; the same for the mins' M)
    halves: scales of block 0, of block 1, word i = D(row i, values 16-31) << 16 | D(row i, values 0-15); the
            mins likewise
    4-bit codes, vector v of a block: byte 4 i + j = code(row i, k = 8 v + j) | code(row i, k = 8 v + 4 + j) << 4
    8-bit codes (unsigned, 128 = 0 for symmetric ones), vector g: byte 4 i + j = code(row i, k = 4 g + j)

so each `vrmpy(Vu.ub, Rt.b)` multiplies 4 codes of all 32 rows by one word of 4 activations, and the two nibble
planes of a vector come out with one vand and one vlsr (no shuffles). The scales become 16-bit fixed point with a
power of two per row: d = D 2^E_row, E_row the smallest exponent that fits the row's largest |d| in 15 bits. A
scale within 2^4 of its row's largest keeps every bit of a float16; smaller ones round to 2^-16 of the largest
(an error ~2^-16 of the row's weights, far below the 4-bit codes' own). K-quant scales d sc (float32: up to 17
significant bits for Q4_K/Q5_K, 18 for Q6_K) round the same way, to 2^-16 of the row's largest: an error of the
size of the kernel's own rounding of each block's product of weight and activation scales to 16 bits, which every
format has. `row_factors` holds 2^E_row (and the mins' 2^F_row) per row.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import MobilecError
from .group import HVX_HALF_GROUP, HVX_ROWS, HVX_VECTOR_BYTES, GroupLayout, plain_codes, takes_code_order, unpack_codes

ROWS = HVX_ROWS  # vector lanes: rows per tile
BLOCK = 32  # values per activation block, and per scale but in halves
HALF = HVX_HALF_GROUP  # values per scale in halves
VECTOR_BYTES = HVX_VECTOR_BYTES
FIXED_MAX = (1 << 15) - 1
# The kernel's int32 row sums cannot overflow up to this K (hvx_gemv.c: each block's term is under 2^21).
MAX_K = 32768


@dataclasses.dataclass(frozen=True)
class HvxWeights:
    """One weight in the HVX GEMV's layout."""

    data: np.ndarray  # uint8, the tiles' records
    row_factors: np.ndarray  # float32 [n_tiles, 2, 32]: 2^E (dot term), 2^F (mins term) per row
    n: int
    k: int
    bits: int
    mins: bool  # asymmetric codes: the record holds the mins
    zero: int  # the code of 0 for symmetric codes, 0 for asymmetric ones
    halves: bool  # a scale (and min) per 16 values (GGUF Q6_K), not per 32

    @property
    def n_tiles(self) -> int:
        return -(-self.n // ROWS)

    @property
    def n_pairs(self) -> int:
        return -(-self.k // (2 * BLOCK))


def fixed_point(values: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """values ~ fixed * 2^exponent with |fixed| <= 2^15 - 1, one exponent per slice along `axis` (None: one for all):
    (int16 fixed, float32 2^exponent). All-zero slices get exponent 0."""
    values = np.asarray(values, np.float64)
    largest = np.abs(values).max(axis=axis, keepdims=True)
    # ceil(log2(largest / FIXED_MAX)) exactly, from the float's exponent (hvx_gemv.tir_quantize_activations the same)
    mantissa, exponent = np.frexp(largest / FIXED_MAX)
    exponent = np.where(largest > 0, exponent - (mantissa == 0.5), 0)
    power = np.exp2(exponent.astype(np.float64))
    return np.rint(values / power).astype(np.int16), power.astype(np.float32)


def _halfword_pairs(fixed: np.ndarray) -> np.ndarray:
    """int16 [tiles, 32, pairs, vectors, 2] -> the scale vectors [tiles, pairs, vectors, 128 bytes]: row i's word of
    a vector = pair[1] << 16 | pair[0]."""
    tiles, _, pairs, vectors, _ = fixed.shape
    return np.ascontiguousarray(fixed.transpose(0, 2, 3, 1, 4)).view(np.uint8).reshape(tiles, pairs, vectors,
                                                                                         VECTOR_BYTES)


def relayout(arrays: dict[str, np.ndarray], layout: GroupLayout, k: int) -> HvxWeights:
    """The stored arrays of an [n, k] weight (quantization/group.py, any code order) -> its HVX layout."""
    if not takes_code_order("hvx", layout.bits, layout.group, ROWS):
        raise MobilecError(f"the HVX GEMV takes 4- or 8-bit codes in groups of a multiple of {BLOCK}, or 8-bit ones "
                           f"in groups of {HALF}, not {layout.describe()}; quantize with a g32 or g128 scheme")
    if k > MAX_K:
        raise MobilecError(f"the HVX GEMV takes K up to {MAX_K} (its int32 sums could overflow), not {k}; "
                           "split the weight along K")
    codes = unpack_codes(plain_codes(arrays["q_weight"], layout), layout.bits)[:, :k]
    n = codes.shape[0]
    n_tiles, n_pairs = -(-n // ROWS), -(-k // (2 * BLOCK))
    rows, width = n_tiles * ROWS, n_pairs * 2 * BLOCK
    padded = np.zeros((rows, width), np.uint8)
    padded[:n, :k] = codes
    # [tiles, rows in tile, pairs, block in pair, values]
    blocks = padded.reshape(n_tiles, ROWS, n_pairs, 2, BLOCK)
    if layout.bits == 4:
        # value 8 v + j in the low nibble and 8 v + 4 + j in the high one of vector v: [.., v, half, j]
        split = blocks.reshape(n_tiles, ROWS, n_pairs, 2, 4, 2, 4)
        planes = split[..., 0, :] | (split[..., 1, :] << 4)  # [tiles, rows, pairs, block, v, j]
    else:
        planes = blocks.reshape(n_tiles, ROWS, n_pairs, 2, 8, 4)  # [tiles, rows, pairs, block, g, j]
    # -> [tiles, pairs, block, vector, rows, j]: lane i of a vector holds row i's 4 codes
    code_vectors = planes.transpose(0, 2, 3, 4, 1, 5).reshape(n_tiles, n_pairs, -1, VECTOR_BYTES)

    halves = layout.hvx_halves
    vectors = 1 + halves  # scale vectors a record: [block, half] in halves, else [block]

    def per_block(name: str) -> tuple[np.ndarray, np.ndarray]:
        """The scales (or mins) as fixed point, one per block (halves: per 16 values), groups of 64 or more
        repeated per block, and their power of two per row."""
        given = np.repeat(arrays[name].astype(np.float32), max(1, layout.group // BLOCK), axis=1)
        values = np.zeros((rows, 2 * vectors * n_pairs), np.float32)
        width = min(given.shape[1], values.shape[1])
        values[:n, :width] = given[:, :width]
        fixed, power = fixed_point(values, axis=1)
        return _halfword_pairs(fixed.reshape(n_tiles, ROWS, n_pairs, vectors, 2)), power.reshape(n_tiles, ROWS)

    scales, scale_power = per_block("q_scale")
    parts = [scales]
    min_power = np.ones_like(scale_power)
    if not layout.symmetric:
        mins, min_power = per_block("q_min")
        parts.append(mins)
    data = np.concatenate([*parts, code_vectors], axis=2)
    return HvxWeights(data=data.reshape(-1), row_factors=np.stack([scale_power, min_power], axis=1), n=n, k=k,
                      bits=layout.bits, mins=not layout.symmetric, zero=layout.offset if layout.symmetric else 0,
                      halves=halves)


def stored_arrays(arrays: dict[str, np.ndarray], layout: GroupLayout, k: int) -> dict[str, np.ndarray]:
    """The stored arrays of an [n, k] weight, n a multiple of ROWS -> as the "hvx" code order stores them
    (group.CODE_ORDERS): q_weight [n, bytes] the tiles' records, q_scale [n, 2] the row_factors [tiles, 2, 32]."""
    weights = relayout(arrays, layout, k)
    return {"q_weight": weights.data.reshape(weights.n, -1), "q_scale": weights.row_factors.reshape(weights.n, 2)}
