"""RoPE applied by the model to the fused q/k/v, before attention: for variants TVM's paged KV cache does not
compute (per-frequency factors, cos/sin scaled, part of the head). The cache is then created with RopeMode.NONE and
stores k as given, and attention kernels see the query positions only for masking."""

from __future__ import annotations

import dataclasses

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache


@dataclasses.dataclass(frozen=True)
class RotaryEmbedding:
    """Rotate-half RoPE over the first 2 * len(inv_freq) dims of each q and k head: dims i and i + len(inv_freq)
    rotate by position * inv_freq[i], and the rotated values (cos and sin) are multiplied by `scale`, as transformers
    computes it (in float32)."""

    inv_freq: tuple[float, ...]
    scale: float = 1.0

    @classmethod
    def of_base(cls, theta: float, rotary_dim: int, divisors=1.0, scale: float = 1.0) -> "RotaryEmbedding":
        """inv_freq[i] = 1 / (theta^(2i / rotary_dim) * divisors[i]) (a number: the same for every i), in
        float32 as transformers keeps it."""
        inv_freq = 1 / (theta ** (np.arange(0, rotary_dim, 2) / rotary_dim) * np.asarray(divisors))
        return cls(tuple(float(f) for f in inv_freq.astype(np.float32)), scale)

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    def apply(self, qkv: Tensor, kv_cache: PagedKVCache, rotated_heads: int) -> Tensor:
        """The fused q/k/v [b, s, heads, head_dim] with its first `rotated_heads` heads (q and k) rotated at the
        positions the cache assigns to this forward's tokens."""
        b, s, _, _ = qkv.shape
        positions = kv_cache.get_query_positions(b * s)
        inv_freq = nn.Tensor.from_const(np.asarray(self.inv_freq, "float32"))
        half, scale = len(self.inv_freq), self.scale

        def rotate(x: te.Tensor, pos: te.Tensor, freq: te.Tensor) -> te.Tensor:
            seq = x.shape[1]

            def value(i, t, h, d):
                angle = pos[i * seq + t].astype("float32") * freq[d % half]
                # for d >= rotary_dim both indices stay within the head; the value is not used
                partner = tirx.if_then_else(d < half, -x[i, t, h, d + half], x[i, t, h, d - half]).astype("float32")
                rotated = (x[i, t, h, d].astype("float32") * tirx.cos(angle) + partner * tirx.sin(angle)) * scale
                return tirx.if_then_else(tirx.all(h < rotated_heads, d < 2 * half), rotated.astype(x.dtype),
                                         x[i, t, h, d])

            return te.compute(x.shape, value, name="rotary_embedding")

        return op.tensor_expr_op(rotate, "rotary_embedding", [qkv, positions, inv_freq])
