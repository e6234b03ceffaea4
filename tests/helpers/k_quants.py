"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) for tests: gguf 0.19 dequantizes them but cannot quantize them
(NotImplementedError) and llama-cpp-python is not installed, so this packs them from float weights with a plain
min/max rounding (not llama.cpp's search: any valid blocks do). Written from ggml's block layout, independently
of compiler/quantization/gguf_blocks.py; tests check these blocks against gguf's own dequantizer."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
SUPER_BLOCK = 256


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    """float [rows, blocks] -> its fp16 bytes [rows, blocks, 2]."""
    return values.astype(np.float16)[..., None].view(np.uint8)


def pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit sc, m [..., 8] -> Q4_K/Q5_K's 12 scale bytes: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (sc) and
    4-7 (m); 4-7 split into a nibble of bytes 8-11 (sc low, m high) and 2 bits on top of bytes 0-3 / 4-7."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    first = sc[..., :4] | (sc[..., 4:] >> 4 << 6)
    second = m[..., :4] | (m[..., 4:] >> 4 << 6)
    nibbles = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    return np.concatenate([first, second, nibbles], axis=-1)


def pack_q4k_q5k(qtype: Q, d, dmin, sc, m, codes) -> np.ndarray:
    """d, dmin [rows, nb]; sc, m [rows, nb, 8]; codes [rows, nb, 256] (0..15 or 0..31) -> bytes [rows, nb * size]."""
    rows, nb, _ = codes.shape
    sub = codes.astype(np.uint8).reshape(rows, nb, 4, 2, 32)  # pairs of sub-blocks share 32 nibble bytes
    nibbles = (sub[:, :, :, 0] & 0x0F) | ((sub[:, :, :, 1] & 0x0F) << 4)
    parts = [_fp16_bytes(d), _fp16_bytes(dmin), pack_scales_mins(sc, m)]
    if qtype == Q.Q5_K:
        fifth = (codes.astype(np.uint8).reshape(rows, nb, 8, 32) >> 4) & 1
        parts.append((fifth << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=2, dtype=np.uint8))
    parts.append(nibbles.reshape(rows, nb, 128))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def pack_q6k(d, scales, codes) -> np.ndarray:
    """d [rows, nb]; int8 scales [rows, nb, 16]; codes [rows, nb, 256] (0..63) -> bytes [rows, nb * 210]."""
    rows, nb, _ = codes.shape
    c = codes.astype(np.uint8).reshape(rows, nb, 2, 128)  # two halves of 128 values
    low = (c[..., :64] & 0x0F) | ((c[..., 64:] & 0x0F) << 4)  # value r and r + 64 share a byte
    high = c.reshape(rows, nb, 2, 4, 32) >> 4  # value r, r + 32, r + 64, r + 96 share a byte, 2 bits each
    high = (high << np.array([0, 2, 4, 6], np.uint8)[:, None]).sum(axis=3, dtype=np.uint8)
    parts = [low.reshape(rows, nb, 128), high.reshape(rows, nb, 64), scales.astype(np.int8).view(np.uint8),
             _fp16_bytes(d)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> the K-quant bytes [rows, K / 256 * block bytes]."""
    rows, k = w.shape
    nb = k // SUPER_BLOCK
    if qtype == Q.Q6_K:
        x = w.reshape(rows, nb, 16, 16).astype(np.float32)
        sub_scale = np.abs(x).max(axis=3) / 31
        d = (sub_scale.max(axis=2) / 127).astype(np.float16).astype(np.float32)
        scales = np.clip(np.round(np.divide(sub_scale, d[..., None], out=np.zeros_like(sub_scale),
                                            where=d[..., None] > 0)), -128, 127)
        step = (d[..., None] * scales)[..., None]
        codes = np.clip(np.round(np.divide(x, step, out=np.zeros_like(x), where=step != 0)) + 32, 0, 63)
        return pack_q6k(d, scales, codes.reshape(rows, nb, 256))
    levels = 15 if qtype == Q.Q4_K else 31
    x = w.reshape(rows, nb, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(axis=3), 0)
    sub_scale, sub_min = (x.max(axis=3) - lo) / levels, -lo
    d = (sub_scale.max(axis=2) / 63).astype(np.float16).astype(np.float32)
    dmin = (sub_min.max(axis=2) / 63).astype(np.float16).astype(np.float32)

    def six_bits(v, unit):
        return np.clip(np.round(np.divide(v, unit[..., None], out=np.zeros_like(v), where=unit[..., None] > 0)), 0, 63)

    sc, m = six_bits(sub_scale, d), six_bits(sub_min, dmin)
    step, offset = (d[..., None] * sc)[..., None], (dmin[..., None] * m)[..., None]
    codes = np.clip(np.round(np.divide(x + offset, step, out=np.zeros_like(x), where=step > 0)), 0, levels)
    return pack_q4k_q5k(qtype, d, dmin, sc, m, codes.reshape(rows, nb, 256))
