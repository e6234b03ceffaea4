"""Qwen3 decoder: the Llama structure with an RMSNorm over head_dim on every q and k head (q_norm, k_norm)
before RoPE, no q/k/v bias (attention_bias, false in released configs), and head_dim stated in the config
(Qwen3-0.6B: 16 heads of 128 on a hidden size of 1024)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .llama import LlamaConfig
from .qwen2 import Qwen2ForCausalLM, qwen_sliding_layers
from .sliding_layers import SlidingLayers


@dataclasses.dataclass
class Qwen3Config(SlidingLayers, LlamaConfig):
    """qk_norm on; the rest read as Llama's (head_dim, attention_bias, tie_word_embeddings, rope), and the sliding
    layers as Qwen2's."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "Qwen3Config":
        base = super().from_hf(hf, context_window)
        return dataclasses.replace(base, qk_norm=True, **qwen_sliding_layers(hf, base))


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen2's functions, KV cache and sliding layers; LlamaAttention applies q_norm and k_norm to the fused q/k/v
    projection before the KV cache's RoPE and attention (config.qk_norm)."""
