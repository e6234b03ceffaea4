"""GGUF's quantized blocks re-laid into our group layouts, with exactly the same dequantized values.

Q4_0 / Q4_1 / Q8_0 keep their bytes (codes and fp16 scales). The K-quants pack 256 values per super-block with
fp16 `d` (and `dmin`) and 6- or 8-bit integer scales per sub-block; each sub-block's scale d * sc and min dmin * m
is exact in float32 (11 mantissa bits times an integer of at most 8 bits), so they become 32-value (Q4_K, Q5_K)
groups with float32 scales and mins, or 16-value (Q6_K) groups with float32 scales about code 32, and every
product code * scale is exact too (at most 24 significant bits): the stored values are gguf's, bit for bit. The
price is bytes: 6 / 10 / 10 bits per weight instead of the file's 4.5 / 5.5 / 6.5625.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import MobilecError
from .group import GroupLayout, order_codes, pack_codes, paired, unpack_codes, unpaired

# ggml type -> our layout
LAYOUTS: dict[str, GroupLayout] = {
    "Q4_0": GroupLayout(4, 32, True, "float16"),  # f16 d, 16 bytes of nibbles: w = (q - 8) d
    "Q4_1": GroupLayout(4, 32, False, "float16"),  # f16 d, f16 m, nibbles: w = q d + m
    "Q8_0": GroupLayout(8, 32, True, "float16"),  # f16 d, 32 int8: w = q d  (stored as q + 128)
    "Q4_K": GroupLayout(4, 32, False, "float32"),  # w = (d sc) q - dmin m, q 4 bits, sc and m 6 bits
    "Q5_K": GroupLayout(8, 32, False, "float32"),  # as Q4_K with 5-bit q (8-bit codes: we have no 5-bit layout)
    "Q6_K": GroupLayout(8, 16, True, "float32", zero_code=32),  # w = (d sc) (q - 32), q 6 bits, sc int8
}
FLOAT_TYPES = ("F32", "F16")
SUPPORTED_TYPES = ", ".join([*LAYOUTS, *FLOAT_TYPES])


def keeps_every_type(ggml_types) -> bool:
    """Whether every ggml type name in `ggml_types` is one `--quant gguf` keeps."""
    return all(t in LAYOUTS or t in FLOAT_TYPES for t in ggml_types)


def _one_layout(ggml_type: str, tensor: str) -> GroupLayout | None:
    if ggml_type in FLOAT_TYPES:
        return None
    if ggml_type not in LAYOUTS:
        raise MobilecError(
            f"GGUF tensor {tensor} is {ggml_type}, which --quant gguf cannot keep "
            f"(supported: {SUPPORTED_TYPES}); use --quant q4f16_g32_asym or another scheme"
        )
    return LAYOUTS[ggml_type]


def layout_for(ggml_types: dict[str, str], joined: str) -> GroupLayout | None:
    """Our layout for GGUF tensors (name -> ggml type) joined along N into the layer `joined` (q/k/v, gate/up);
    None for float tensors (kept as float). Tensors of different types (Q4_K_M stores some v and down projections
    as Q6_K) share the layout that holds each exactly: the most bits, the smallest group, asymmetric, float32
    scales."""
    layouts = {_one_layout(t, name) for name, t in ggml_types.items()}
    if len(layouts) == 1:
        return layouts.pop()
    if None in layouts:
        raise MobilecError(f"{joined} joins GGUF tensors of types {sorted(set(ggml_types.values()))}, float and "
                           "quantized; --quant gguf needs them all quantized or all float")
    group = min(lay.group for lay in layouts)
    assert all(lay.group % group == 0 for lay in layouts), layouts
    return GroupLayout(max(lay.bits for lay in layouts), group, False, "float32")


def _widen(arrays: dict[str, np.ndarray], layout: GroupLayout, wide: GroupLayout) -> dict[str, np.ndarray]:
    """`layout`'s arrays in the wider asymmetric float32 `wide`, each value unchanged (a symmetric min -offset * d
    and fp16 -> float32 are exact)."""
    scale = arrays["q_scale"].astype(np.float32)
    minv = scale * np.float32(-layout.offset) if layout.symmetric else arrays["q_min"].astype(np.float32)
    repeat = layout.group // wide.group
    return {"q_weight": pack_codes(unpack_codes(arrays["q_weight"], layout.bits), wide.bits),
            "q_scale": np.repeat(scale, repeat, axis=1), "q_min": np.repeat(minv, repeat, axis=1)}


def convert_blocks(ggml_type: str, raw: np.ndarray, layout: GroupLayout) -> dict[str, np.ndarray]:
    """Raw blocks [rows, bytes] -> {q_weight, q_scale[, q_min]} in `layout` (`layout_for` of the joined types, in
    the target's code order)."""
    rows = raw.shape[0]
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]][1]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)
    own = LAYOUTS[ggml_type]
    arrays = _legacy(ggml_type, blocks) if ggml_type in ("Q4_0", "Q4_1", "Q8_0") else _k_quant(ggml_type, blocks)
    plain = dataclasses.replace(layout, code_order="plain")
    arrays = arrays if own == plain else _widen(arrays, own, plain)
    return {**arrays, "q_weight": order_codes(arrays["q_weight"], layout)}


def convert_joined(parts: list[tuple[str, np.ndarray]], layout: GroupLayout) -> dict[str, np.ndarray]:
    """(ggml type, raw blocks) of the parts of one weight joined along N (q, k, v; gate, up) -> the joined arrays in
    `layout`: each part converted with its rows unpaired, the rows paired once joined (a part of an odd number of
    rows would shift the pairs of the next)."""
    arrays = [convert_blocks(ggml_type, raw, unpaired(layout)) for ggml_type, raw in parts]
    return paired({name: np.concatenate([a[name] for a in arrays], axis=0) for name in arrays[0]}, layout)


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, :, start:start + 2].copy().view(np.float16)[:, :, 0]


def _legacy(ggml_type: str, blocks: np.ndarray) -> dict[str, np.ndarray]:
    rows = blocks.shape[0]
    out = {"q_scale": _fp16(blocks, 0)}
    if ggml_type == "Q8_0":
        codes = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    else:
        start = 2
        if ggml_type == "Q4_1":
            out["q_min"] = _fp16(blocks, 2)
            start = 4
        # ggml's nibble order (value j low, j+16 high in byte j) is our 4-bit layout: the bytes are kept as they are.
        codes = blocks[:, :, start:]
    out["q_weight"] = np.ascontiguousarray(codes).reshape(rows, -1)
    return out


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes -> 6-bit (sc, m) of the 8 sub-blocks. Sub-blocks 0-3: the low 6 bits of bytes
    0-3 (sc) and 4-7 (m). Sub-blocks 4-7: the nibbles of bytes 8-11 (sc low, m high) below the top 2 bits of
    bytes 0-3 (sc) and 4-7 (m)."""
    first, second, low_nibbles = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([first & 0x3F, (low_nibbles & 0x0F) | (first >> 6 << 4)], axis=-1)
    m = np.concatenate([second & 0x3F, (low_nibbles >> 4) | (second >> 6 << 4)], axis=-1)
    return sc, m


def _k_quant(ggml_type: str, blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q4_K (144 bytes: d, dmin, 12 scale bytes, 128 nibble bytes), Q5_K (176: the same with 32 bytes of fifth bits
    before the nibbles), Q6_K (210: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d) -> codes per
    value in order, float32 scales (and Q4_K/Q5_K's mins) per sub-block."""
    rows, n_blocks, _ = blocks.shape
    out = {}
    if ggml_type == "Q6_K":
        # values 128h + r of a super-block: low 4 bits from byte 64h + r % 64 (nibble r // 64), high 2 bits from
        # byte 32h + r % 32 (bits 2 (r // 32) and up)
        low = blocks[:, :, :128].reshape(rows, n_blocks, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
        high = blocks[:, :, 128:192].reshape(rows, n_blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        codes = (low & 0x0F).reshape(rows, n_blocks, 256) | ((high & 0x03).reshape(rows, n_blocks, 256) << 4)
        scale = _fp16(blocks, 208).astype(np.float32)[:, :, None] * blocks[:, :, 192:208].view(np.int8)
    else:
        sc, m = _k_scales_mins(blocks[:, :, 4:16])
        scale = _fp16(blocks, 0).astype(np.float32)[:, :, None] * sc
        out["q_min"] = (-(_fp16(blocks, 2).astype(np.float32)[:, :, None] * m)).astype(np.float32).reshape(rows, -1)
        # each 32 nibble bytes hold two sub-blocks: value i of the first in the low nibble of byte i, of the second
        # in the high one
        nibbles = blocks[:, :, -128:].reshape(rows, n_blocks, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        codes = (nibbles & 0x0F).reshape(rows, n_blocks, 256)
        if ggml_type == "Q5_K":  # bit s of byte i: the fifth bit of value i of sub-block s
            fifth = blocks[:, :, 16:48].reshape(rows, n_blocks, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
            codes = codes | ((fifth & 0x01).reshape(rows, n_blocks, 256) << 4)
    out["q_weight"] = pack_codes(codes.reshape(rows, -1), LAYOUTS[ggml_type].bits)
    out["q_scale"] = scale.astype(np.float32).reshape(rows, -1)
    return out
