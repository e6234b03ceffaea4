"""Group-wise integer weight layouts, and their packing and quantization in numpy (the TE dequantize the compiled
kernels inline is in dequantize_te.py)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from ..validate import USABLE_CORES

if TYPE_CHECKING:
    from ..loaders.checkpoint import Rows

# 4-bit codes are stored as ggml's Q4 blocks are: 32 codes in 16 bytes, code j in the low nibble of byte j and
# code j+16 in the high nibble. A CPU vector of 16 consecutive codes is then one 16-byte load and one constant
# shift (packing consecutive codes into a word limits a vector to the codes of one word).
NIBBLE_BLOCK = 32
# How a row's code bytes are ordered. "plain": along K (4-bit: as above). "neon": for the ARM integer-dot kernels
# (kernels/integer_dot_gemv/arm.py, kernels/integer_dot_gemm/arm.py), chosen per target at compile time for codes
# in groups of whole blocks: each set of 4 blocks (INTERLEAVE) has its bytes interleaved by 4-byte words: word c of
# block i at word 4 c + i. A 16-byte load then holds word c of the 4 blocks, and an `sdot` adds each block's
# products to its own lane: one accumulator per step of 4 blocks (4-bit: as the `ld4` that de-interleaved plain
# bytes did, without its vector-pipe cost, llvm-mca Neoverse-N2, SmolLM2 Q4_1: 3.76 -> 3.26 cycles per 32 weights;
# 8-bit: no `addp` of pairs of blocks, the Q8_0 lm_head 2.13 -> 1.88). Blocks past the last whole set stay in place.
# Codes about 128 are stored signed, c ^ 0x80 (GGUF Q8_0's own bytes), which `sdot` and `smmla` take as they are.
# The prefill GEMM re-lays a task's rows into its own order first (kernels/integer_dot_gemm): its `smmla` operands
# are 8-byte runs of one block, which a set interleaved by 4 bytes splits.
# "hvx": the HVX GEMV's and GEMM's tiles of 32 rows (quantization/hvx_blocks.py), 4/8-bit codes in groups of a
# multiple of 32 (a scale per 32-value block) or 8-bit codes in groups of 16 (a scale per 16 values), a multiple of
# 32 rows: scales and mins are re-laid with the codes, so the whole weight is re-laid once it is made
# (quantize_model.py); `order_codes` hands its codes out plain for that. Stored as q_weight [n, bytes] (the tiles'
# records, hvx_blocks.HvxWeights.data) and q_scale [n, 2] float32 (row_factors), no q_min.
# "neon_pairs": 4-bit codes of an even number of rows, the neon order of rows 2p and 2p + 1 merged a nibble each:
# per 16-byte chunk of the neon order (16 bytes of row 2p's codes, 16 of row 2p + 1's, at the same K positions),
# 32 bytes, the chunk's low nibbles of both rows, then its high nibbles, row 2p's code in the low nibble of each
# byte and row 2p + 1's code ^ 8 in the high one (pair_rows). As a signed byte, b = c + 16 (c' - 8) for the two
# codes c, c', so one `sdot` of the raw bytes and one of b & 0x0F (c alone) give both rows' sums (the decode GEMV,
# kernels/integer_dot_gemv/arm.py): per 16 bytes an AND and 2 `sdot`s, where one row's 16 bytes take an AND, a
# shift and 2 `sdot`s. The pair's bytes are rows 2p and 2p + 1 of the stored array, one after the other.
CODE_ORDERS = ("plain", "neon", "neon_pairs", "hvx")
INTERLEAVE = {8: (4, 4), 4: (4, 4)}  # bits -> (blocks per set, bytes per chunk) of the "neon" order
# an order -> the order used where codes cannot take it (with_code_order)
FALLBACK = {"neon_pairs": "neon", "neon": "plain", "hvx": "plain"}
HVX_ROWS = 32  # the hvx order's rows per tile, and its block (hvx_blocks.ROWS, BLOCK)
HVX_HALF_GROUP = 16  # the hvx order's other group: a scale per half block (hvx_blocks.HALF)
HVX_VECTOR_BYTES = 128  # an HVX vector: the hvx order's records are made of them (hvx_blocks.VECTOR_BYTES)
PAIRED_BYTES = 16  # bytes per chunk of a row in neon_pairs: the pair's chunk is twice that
# an order -> its mark in the names of the kernels that read it
ORDER_MARKS = {"plain": "", "neon": "_neon", "neon_pairs": "_neonpairs", "hvx": "_hvx"}


def hvx_record_bytes(bits: int, mins: bool, halves: bool) -> int:
    """Bytes of one hvx tile's record of a pair of blocks (hvx_blocks.py): the scale vectors (two in halves), the
    mins' (asymmetric codes), the codes of two blocks."""
    return ((1 + mins) * (1 + halves) + 2 * bits) * HVX_VECTOR_BYTES


def takes_code_order(order: str, bits: int, group: int, rows: int | None = None) -> bool:
    """Whether codes of `bits` in groups of `group` (of `rows` rows, where known) are stored in `order` (neon: whole
    blocks a group; neon_pairs: also 4-bit and an even number of rows); the kernels that read an order ask this
    too; hvx: 4/8-bit codes in groups of a multiple of 32 or 8-bit ones in groups of 16, rows a multiple of 32."""
    whole_blocks = bits in INTERLEAVE and group % NIBBLE_BLOCK == 0
    if order == "hvx":
        groups = group % HVX_ROWS == 0 or (group == HVX_HALF_GROUP and bits == 8)
        return bits in (4, 8) and groups and rows is not None and rows % HVX_ROWS == 0
    if order == "neon_pairs":
        return whole_blocks and bits == 4 and (rows is None or rows % 2 == 0)
    return order == "plain" or (order == "neon" and whole_blocks)


def signed_codes(order: str, bits: int, symmetric: bool, offset: int) -> bool:
    """Whether the codes are stored as c - 128: 8-bit codes about 128 in the neon order."""
    return order == "neon" and bits == 8 and symmetric and offset == 128


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """`bits`-bit codes (4 or 8) stored as uint8 along K; one scale (and min) per `group` values.

    Symmetric: w = (code - offset) * scale, offset 2^(bits-1) unless `zero_code` is set.  Asymmetric:
    w = code * scale + min.
    Any K is accepted: a K that `group` does not divide (576 with group 128) ends in a shorter group; 4-bit
    codes are stored up to the next 32-code block (zero codes in the padding, sliced away by the kernels).
    """

    bits: int
    group: int
    symmetric: bool
    scale_dtype: str
    zero_code: int | None = None  # symmetric codes' zero other than 2^(bits-1): GGUF Q6_K's 6-bit codes centre on 32
    code_order: str = "plain"  # CODE_ORDERS

    @property
    def offset(self) -> int:
        return 1 << (self.bits - 1) if self.zero_code is None else self.zero_code

    @property
    def hvx_halves(self) -> bool:
        """In the hvx order: a scale (and min) per 16 values, not per 32-value block (hvx_blocks' "halves")."""
        return self.group == HVX_HALF_GROUP

    @property
    def signed_codes(self) -> bool:
        """8-bit codes about 128 stored as c - 128 (the "neon" order)."""
        return signed_codes(self.code_order, self.bits, self.symmetric, self.offset)

    def with_code_order(self, order: str, rows: int | None = None) -> GroupLayout:
        """This layout with its codes in `order` where it takes it (takes_code_order, for a weight of `rows` rows),
        else in the first order of its FALLBACK chain that it takes."""
        if order not in CODE_ORDERS:
            raise ValueError(f"code order must be one of {CODE_ORDERS}, got {order!r}")
        if order in ("neon_pairs", "hvx") and rows is None:
            raise ValueError(f"the {order} order groups rows: give the weight's rows")
        while not takes_code_order(order, self.bits, self.group, rows):
            order = FALLBACK[order]
        return dataclasses.replace(self, code_order=order)

    def padded_k(self, k: int) -> int:
        """K rounded up to whole groups: the zero-padded width used while computing scales."""
        return -(-k // self.group) * self.group

    def stored_k(self, k: int) -> int:
        """The number of codes actually stored per row."""
        return -(-k // NIBBLE_BLOCK) * NIBBLE_BLOCK if self.bits == 4 else k

    def shapes(self, n: int, k: int) -> dict[str, tuple[tuple[int, int], str]]:
        """Parameter suffix -> (shape, dtype) of the stored arrays for an [n, k] weight."""
        groups = self.padded_k(k) // self.group
        if self.code_order == "hvx":  # hvx_blocks.relayout: each tile's 2-block records spread over its 32 rows
            record_row_bytes = hvx_record_bytes(self.bits, not self.symmetric, self.hvx_halves) // HVX_ROWS
            return {"q_weight": ((n, -(-k // (2 * HVX_ROWS)) * record_row_bytes), "uint8"),
                    "q_scale": ((n, 2), "float32")}
        out = {"q_weight": ((n, self.stored_k(k) * self.bits // 8), "uint8"), "q_scale": ((n, groups), self.scale_dtype)}
        if not self.symmetric:
            out["q_min"] = ((n, groups), self.scale_dtype)
        return out

    def describe(self) -> str:
        kind = "asymmetric (scale + min)"
        if self.symmetric:
            kind = "symmetric" if self.zero_code is None else f"symmetric about code {self.zero_code}"
        order = {"plain": "", "neon": ", codes in ARM dot-product order",
                 "neon_pairs": ", codes in ARM dot-product order, rows in pairs",
                 "hvx": ", re-laid for the HVX GEMV"}[self.code_order]
        return f"int{self.bits} {kind}, group {self.group}, {self.scale_dtype} scales{order}"


def output_layer_layout(layout: GroupLayout) -> GroupLayout:
    """The token table and output projection keep 8 bits in groups of 32, as llama.cpp's 4-bit files do: int4
    there alone cost SmolLM2 +3.6% perplexity. An untied table costs nothing per token (decode reads one row)."""
    return GroupLayout(8, 32, True, layout.scale_dtype)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint codes [n, kc] -> uint8 [n, kc * bits / 8] (for 4 bits kc is a multiple of 32; see NIBBLE_BLOCK)."""
    if bits == 8:
        return codes.astype(np.uint8)
    n, kc = codes.shape
    c = codes.astype(np.uint8).reshape(n, kc // NIBBLE_BLOCK, 2, NIBBLE_BLOCK // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, kc // 2)


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed.astype(np.uint8)
    n = packed.shape[0]
    b = packed.reshape(n, -1, NIBBLE_BLOCK // 2)
    return np.concatenate([b & 0x0F, b >> 4], axis=2).reshape(n, -1)


def interleaved_bytes(row_bytes: int, bits: int) -> int:
    """Bytes of a row's prefix made of whole sets of blocks (the "neon" order interleaves those, INTERLEAVE)."""
    set_bytes = INTERLEAVE[bits][0] * NIBBLE_BLOCK * bits // 8
    return row_bytes // set_bytes * set_bytes


def _sets(codes: np.ndarray, layout: GroupLayout, interleaved: bool) -> np.ndarray:
    """The interleaved prefix of a row's bytes as [n, sets, blocks, chunks, chunk] (plain) or [n, sets, chunks,
    blocks, chunk] (interleaved): a transpose of the two middle axes turns one into the other."""
    blocks, chunk = INTERLEAVE[layout.bits]
    chunks = NIBBLE_BLOCK * layout.bits // 8 // chunk
    prefix = codes[:, :interleaved_bytes(codes.shape[1], layout.bits)]
    inner = (chunks, blocks) if interleaved else (blocks, chunks)
    return prefix.reshape(codes.shape[0], -1, *inner, chunk)


def order_codes(packed: np.ndarray, layout: GroupLayout) -> np.ndarray:
    """Plain code bytes [n, bytes] -> the layout's code order (CODE_ORDERS; hvx: plain, see CODE_ORDERS)."""
    if layout.code_order in ("plain", "hvx"):
        return packed
    out = packed.copy()
    prefix = interleaved_bytes(packed.shape[1], layout.bits)
    out[:, :prefix] = _sets(packed, layout, False).transpose(0, 1, 3, 2, 4).reshape(packed.shape[0], prefix)
    if layout.code_order == "neon_pairs":
        return pair_rows(out)
    return out ^ np.uint8(0x80) if layout.signed_codes else out


def plain_codes(stored: np.ndarray, layout: GroupLayout) -> np.ndarray:
    """The inverse of order_codes."""
    if layout.code_order in ("plain", "hvx"):
        return stored
    if layout.code_order == "neon_pairs":
        out = unpair_rows(stored)
    else:
        out = stored ^ np.uint8(0x80) if layout.signed_codes else stored.copy()
    prefix = interleaved_bytes(stored.shape[1], layout.bits)
    out[:, :prefix] = _sets(out, layout, True).transpose(0, 1, 3, 2, 4).reshape(stored.shape[0], prefix)
    return out


def pair_rows(neon: np.ndarray) -> np.ndarray:
    """4-bit codes in the neon order [n, bytes], n even -> neon_pairs: per pair of rows and 16-byte chunk, the low
    nibbles of both rows' bytes (row 2p's low, row 2p + 1's ^ 8 high), then their high nibbles."""
    n, width = neon.shape
    rows = neon.reshape(n // 2, 2, width // PAIRED_BYTES, PAIRED_BYTES)
    nibbles = np.stack([rows & 0x0F, rows >> 4], axis=3)  # [pair, row, chunk, nibble, byte]
    paired = nibbles[:, 0] | ((nibbles[:, 1] ^ 8) << 4)  # [pair, chunk, nibble, byte]
    return paired.reshape(n, width).astype(np.uint8)


def paired_position(first_row, index, nibble, row_bytes: int):
    """(row, column) of the stored byte holding nibble `nibble` of byte `index` (in the neon order) of a row of the
    pair from `first_row` (neon_pairs, row_bytes bytes a row): per chunk, the pair's low nibbles, then its high ones,
    the pair's bytes running on from its first row into the second. Plain ints or TIR/TE expressions."""
    at = index // PAIRED_BYTES * 2 * PAIRED_BYTES + nibble * PAIRED_BYTES + index % PAIRED_BYTES
    return first_row + at // row_bytes, at % row_bytes


def unpaired(layout: GroupLayout) -> GroupLayout:
    """The layout its rows are in before pair_rows: parts of a weight joined along N are paired once joined (a part
    with an odd number of rows would shift the pairs of the next)."""
    if layout.code_order != "neon_pairs":
        return layout
    return dataclasses.replace(layout, code_order=FALLBACK[layout.code_order])


def paired(arrays: dict[str, np.ndarray], layout: GroupLayout) -> dict[str, np.ndarray]:
    """Arrays stored in unpaired(layout) -> in `layout`."""
    return {**arrays, "q_weight": pair_rows(arrays["q_weight"])} if layout.code_order == "neon_pairs" else arrays


def unpair_rows(paired: np.ndarray) -> np.ndarray:
    """The inverse of pair_rows."""
    n, width = paired.shape
    chunks = paired.reshape(n // 2, width // PAIRED_BYTES, 2, PAIRED_BYTES)  # [pair, chunk, nibble, byte]
    rows = np.stack([chunks & 0x0F, (chunks >> 4) ^ 8], axis=1)  # [pair, row, chunk, nibble, byte]
    return (rows[:, :, :, 0] | (rows[:, :, :, 1] << 4)).reshape(n, width).astype(np.uint8)


def scale_candidates(layout: GroupLayout) -> np.ndarray:
    """Scales tried per group, as multiples of (largest magnitude / -2^(bits-1)); the least squared error wins.

    8 bits: 1 to 1.2 (a wider grid than the largest value needs can round the rest better): SmolLM2 q8f16_g128
    perplexity +0.51% -> +0.03%; and 128/127, the grid of GGUF Q8_0 (scale = largest magnitude / 127), on which
    weights that were Q8_0 (SmolLM2's embedding) quantize without error. 4 bits: 1 only (plain_grid). The same
    search there lowered the error but not perplexity (q4f16_g32 +19.6% -> +17.5%, q4f16_g128 +44% -> +48%, with
    AWQ+GPTQ +15.4% -> +20.1%); at 16 levels the largest magnitudes, kept exact at 1, matter more than the mean
    error. Below 1 (clipping) was worse still.
    """
    return np.append(np.linspace(1.0, 1.2, 17), 128 / 127) if layout.bits == 8 else np.ones(1)


def plain_grid(layout: GroupLayout) -> bool:
    """Whether the layout's scale is the plain grid's (one candidate: 4 bits), its codes taken as llama.cpp's Q4_0
    quantizer takes them (_symmetric)."""
    return len(scale_candidates(layout)) == 1


def _symmetric(g: np.ndarray, layout: GroupLayout) -> tuple[np.ndarray, np.ndarray]:
    """[n, groups, group] values -> the [n, groups] scale (in the stored dtype) and the codes. The plain grid (the
    signed largest magnitude onto code 0): codes as llama.cpp's Q4_0 quantizer makes them, from the float32 scale
    before its rounding to the stored dtype, halves rounded up, so q4f16_g32 stores, bit for bit, the Q4_0 blocks
    llama.cpp (and gguf's quantizer) write for the same weights (codes taken against the rounded scale instead differ
    in ~0.05% of SmolLM2's codes, with no lower error). Searched scales: the candidate that minimizes squared error,
    codes taken against it as stored."""
    idx = np.abs(g).argmax(axis=2)[:, :, None]
    base = np.take_along_axis(g, idx, axis=2)[:, :, 0] / np.float32(-layout.offset)
    if plain_grid(layout):  # nothing to choose between: skip the error computation
        inv = np.divide(np.float32(1), base, out=np.zeros_like(base), where=base != 0)[:, :, None]
        codes = np.clip(np.floor(g * inv + np.float32(layout.offset + 0.5)), 0, (1 << layout.bits) - 1)
        return base.astype(layout.scale_dtype), codes
    best_err = np.full(base.shape, np.inf, np.float32)
    best = np.zeros(base.shape, np.float32)
    for t in scale_candidates(layout):
        s = (base * np.float32(t)).astype(layout.scale_dtype).astype(np.float32)
        q = _symmetric_codes(g, s[:, :, None], layout) - layout.offset
        err = np.square(q * s[:, :, None] - g).sum(axis=2)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, s, best)
    return best.astype(layout.scale_dtype), _symmetric_codes(g, best[:, :, None], layout)


def _symmetric_codes(g: np.ndarray, s: np.ndarray, layout: GroupLayout) -> np.ndarray:
    q = np.round(np.divide(g, s, out=np.zeros_like(g), where=s != 0)) + layout.offset
    return np.clip(q, 0, (1 << layout.bits) - 1)


QUANTIZE_CHUNK_BYTES = 8 << 20  # float32 rows quantized at a time, so the temporaries stay small for any tensor


def quantize(w: np.ndarray | Rows, layout: GroupLayout) -> dict[str, np.ndarray]:
    """Float [n, k] -> the stored arrays. Searched scales (8 bits): codes computed from the scale as stored (after
    dtype rounding); the plain grid (4 bits): as llama.cpp's Q4_0 (_symmetric). Rows are independent, so they are
    quantized QUANTIZE_CHUNK_BYTES at a time (an even count: neon_pairs pairs rows) on every core (numpy lets go of
    the GIL in its loops); `w` may be checkpoint Rows, read as they are quantized. Whole, an 8B model's embedding
    would need ~8 float32 copies of itself."""
    n, k = w.shape
    step = max(2, QUANTIZE_CHUNK_BYTES // (4 * max(k, 1)) // 2 * 2)
    first = _quantize_rows(w[0:step], layout)
    if n <= step:
        return first
    out = {key: np.empty((n, *a.shape[1:]), a.dtype) for key, a in first.items()}

    def chunk(start: int) -> None:
        for key, a in (first if start == 0 else _quantize_rows(w[start:start + step], layout)).items():
            out[key][start:start + step] = a

    with concurrent.futures.ThreadPoolExecutor(USABLE_CORES) as pool:
        list(pool.map(chunk, range(0, n, step)))
    return out


def _quantize_rows(w: np.ndarray, layout: GroupLayout) -> dict[str, np.ndarray]:
    n, k = w.shape
    kp = layout.padded_k(k)
    wp = np.zeros((n, kp), np.float32)
    wp[:, :k] = w
    g = wp.reshape(n, kp // layout.group, layout.group)
    qmax = (1 << layout.bits) - 1
    if layout.symmetric:
        scale, codes = _symmetric(g, layout)
        out = {"q_scale": scale}
    else:
        lo = g.min(axis=2)
        scale = ((g.max(axis=2) - lo) / qmax).astype(layout.scale_dtype)
        minv = lo.astype(layout.scale_dtype)
        s = scale.astype(np.float32)[:, :, None]
        codes = np.clip(np.round(np.divide(g - minv.astype(np.float32)[:, :, None], s, out=np.zeros_like(g), where=s != 0)), 0, qmax)
        out = {"q_scale": scale, "q_min": minv}
    packed = pack_codes(stored_codes(codes.reshape(n, kp), layout.stored_k(k)), layout.bits)
    out["q_weight"] = order_codes(packed, layout)
    return out


def stored_codes(codes: np.ndarray, stored_k: int) -> np.ndarray:
    """Codes [n, padded K] cut or zero-extended to the stored width."""
    out = np.zeros((codes.shape[0], stored_k), np.uint8)
    width = min(stored_k, codes.shape[1])
    out[:, :width] = codes[:, :width]
    return out


def dequantize(arrays: dict[str, np.ndarray], layout: GroupLayout, k: int) -> np.ndarray:
    """The stored arrays -> float32 [n, k]: the numpy reference of `dequantize_te`."""
    codes = unpack_codes(plain_codes(arrays["q_weight"], layout), layout.bits).astype(np.float32)[:, :k]
    scale = np.repeat(arrays["q_scale"].astype(np.float32), layout.group, axis=1)[:, :k]
    if layout.symmetric:
        minv = scale * np.float32(-layout.offset)  # as the kernels compute it (dequantize_te._value)
    else:
        minv = np.repeat(arrays["q_min"].astype(np.float32), layout.group, axis=1)[:, :k]
    return codes * scale + minv
