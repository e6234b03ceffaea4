"""Group-wise integer weight layouts: packing in numpy, and the TE dequantize the compiled kernels inline."""

from __future__ import annotations

import dataclasses

import numpy as np
from tvm import te, tirx


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """`bits`-bit codes packed little-end-first into uint32 words along K; one scale (and min) per `group` values.

    Symmetric: w = (code - 2^(bits-1)) * scale.  Asymmetric: w = code * scale + min.
    Any K is accepted: a K that `group` does not divide (576 with group 128) ends in a shorter group, and
    codes are stored only up to the next whole word, so padding costs no bytes per token.
    """

    bits: int
    group: int
    symmetric: bool
    scale_dtype: str

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    @property
    def offset(self) -> int:
        return 1 << (self.bits - 1)

    def padded_k(self, k: int) -> int:
        """K rounded up to whole groups: the zero-padded width used while computing scales."""
        return -(-k // self.group) * self.group

    def stored_k(self, k: int) -> int:
        """K rounded up to whole uint32 words: the codes actually stored."""
        return -(-k // self.per_word) * self.per_word

    def shapes(self, n: int, k: int) -> dict[str, tuple[tuple[int, int], str]]:
        """Parameter suffix -> (shape, dtype) of the stored arrays for an [n, k] weight."""
        groups = self.padded_k(k) // self.group
        out = {"q_weight": ((n, self.stored_k(k) // self.per_word), "uint32"), "q_scale": ((n, groups), self.scale_dtype)}
        if not self.symmetric:
            out["q_min"] = ((n, groups), self.scale_dtype)
        return out

    def describe(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric (scale + min)"
        return f"int{self.bits} {kind}, group {self.group}, {self.scale_dtype} scales"


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint codes [n, kp] (kp a multiple of 32/bits) -> uint32 words [n, kp*bits/32]; value j in bits j*bits.."""
    per = 32 // bits
    n, kp = codes.shape
    c = codes.astype(np.uint32).reshape(n, kp // per, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(c << shifts, axis=2).astype(np.uint32)


def unpack_codes(words: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    codes = (words[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(words.shape[0], -1)


def _symmetric_scale(g: np.ndarray, layout: GroupLayout) -> np.ndarray:
    """As ggml's Q4_0: the largest-magnitude value maps exactly onto the code range's longer (negative) end,
    so the grid spends all 2^bits levels; clipping outliers instead costs LLMs more than it gains."""
    idx = np.abs(g).argmax(axis=2)[:, :, None]
    extreme = np.take_along_axis(g, idx, axis=2)[:, :, 0]
    return (extreme / -layout.offset).astype(layout.scale_dtype)


def quantize(w: np.ndarray, layout: GroupLayout) -> dict[str, np.ndarray]:
    """Float [n, k] -> the stored arrays. Codes are computed from the scale as stored (after dtype rounding)."""
    n, k = w.shape
    kp = layout.padded_k(k)
    wp = np.zeros((n, kp), np.float32)
    wp[:, :k] = w
    g = wp.reshape(n, kp // layout.group, layout.group)
    qmax = (1 << layout.bits) - 1
    if layout.symmetric:
        scale = _symmetric_scale(g, layout)
        s = scale.astype(np.float32)[:, :, None]
        codes = np.clip(np.round(np.divide(g, s, out=np.zeros_like(g), where=s != 0)) + layout.offset, 0, qmax)
        out = {"q_scale": scale}
    else:
        lo = g.min(axis=2)
        scale = ((g.max(axis=2) - lo) / qmax).astype(layout.scale_dtype)
        minv = lo.astype(layout.scale_dtype)
        s = scale.astype(np.float32)[:, :, None]
        codes = np.clip(np.round(np.divide(g - minv.astype(np.float32)[:, :, None], s, out=np.zeros_like(g), where=s != 0)), 0, qmax)
        out = {"q_scale": scale, "q_min": minv}
    out["q_weight"] = pack_codes(codes.reshape(n, kp)[:, : layout.stored_k(k)].astype(np.uint32), layout.bits)
    return out


def dequantize(arrays: dict[str, np.ndarray], layout: GroupLayout, k: int) -> np.ndarray:
    """The stored arrays -> float32 [n, k]: the numpy reference of `dequantize_te`."""
    codes = unpack_codes(arrays["q_weight"], layout.bits).astype(np.float32)[:, :k]
    scale = np.repeat(arrays["q_scale"].astype(np.float32), layout.group, axis=1)[:, :k]
    if layout.symmetric:
        w = (codes - layout.offset) * scale
    else:
        w = codes * scale + np.repeat(arrays["q_min"].astype(np.float32), layout.group, axis=1)[:, :k]
    return w


def _code(q: te.Tensor, row, col, layout: GroupLayout):
    word = q[row, col // layout.per_word]
    shift = ((col % layout.per_word) * layout.bits).astype("uint32")
    return (word >> shift) & tirx.const((1 << layout.bits) - 1, "uint32")


def _value(code, scale, minv, layout: GroupLayout, dtype: str):
    if layout.symmetric:
        return (code.astype(dtype) - tirx.const(layout.offset, dtype)) * scale.astype(dtype)
    return code.astype(dtype) * scale.astype(dtype) + minv.astype(dtype)


def dequantize_te(layout: GroupLayout, k: int, dtype: str):
    """A TE function (q_weight, q_scale[, q_min]) -> [n, k] weights in `dtype`; inlined into the consuming matmul."""

    def compute(q: te.Tensor, scale: te.Tensor, minv: te.Tensor | None = None) -> te.Tensor:
        n = q.shape[0]
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
            return _value(_code(q, row, j, layout), scale[row, j // layout.group],
                          None if minv is None else minv[row, j // layout.group], layout, dtype)

        return te.compute((ids.shape[0], k), value, name="take_dequantize")

    return compute
