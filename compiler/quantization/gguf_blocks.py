"""GGUF's Q4_0 / Q4_1 / Q8_0 blocks re-laid into our group layouts, with exactly the same dequantized values."""

from __future__ import annotations

import numpy as np

from ..errors import MobilecError
from .group import GroupLayout

# ggml type -> (our layout, bytes per 32-value block)
LAYOUTS: dict[str, tuple[GroupLayout, int]] = {
    "Q4_0": (GroupLayout(4, 32, True, "float16"), 18),  # f16 d, 16 bytes of nibbles: w = (q - 8) d
    "Q4_1": (GroupLayout(4, 32, False, "float16"), 20),  # f16 d, f16 m, nibbles: w = q d + m
    "Q8_0": (GroupLayout(8, 32, True, "float16"), 34),  # f16 d, 32 int8: w = q d  (stored as q + 128)
}
FLOAT_TYPES = ("F32", "F16")


def layout_for(ggml_type: str, tensor: str) -> GroupLayout | None:
    """Our layout for a GGUF tensor type; None for float tensors (kept as float)."""
    if ggml_type in FLOAT_TYPES:
        return None
    if ggml_type not in LAYOUTS:
        raise MobilecError(
            f"GGUF tensor {tensor} is {ggml_type}, which --quant gguf cannot keep "
            f"(supported: {', '.join(LAYOUTS)}); use --quant q4f16_g32_asym or another scheme"
        )
    return LAYOUTS[ggml_type][0]


def convert_blocks(ggml_type: str, raw: np.ndarray) -> dict[str, np.ndarray]:
    """Raw blocks [rows, bytes] -> {q_weight, q_scale[, q_min]} in the layout of `layout_for`."""
    layout, block_bytes = LAYOUTS[ggml_type]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    out = {"q_scale": d}
    if ggml_type == "Q8_0":
        codes = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    else:
        start = 2
        if ggml_type == "Q4_1":
            out["q_min"] = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0]
            start = 4
        # ggml's nibble order (value j low, j+16 high in byte j) is our 4-bit layout: the bytes are kept as they are.
        codes = blocks[:, :, start:]
    out["q_weight"] = np.ascontiguousarray(codes).reshape(rows, -1)
    return out
