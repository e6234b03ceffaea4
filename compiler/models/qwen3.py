"""Qwen3 decoder: the Llama structure with an RMSNorm over head_dim on every q and k head (q_norm, k_norm)
before RoPE, no q/k/v bias (attention_bias, false in released configs), and head_dim stated in the config
(Qwen3-0.6B: 16 heads of 128 on a hidden size of 1024)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .llama import LlamaConfig, LlamaForCausalLM
from .qwen2 import refuse_sliding_window


class Qwen3Config(LlamaConfig):
    """qk_norm on; the rest read as Llama's (head_dim, attention_bias, tie_word_embeddings, rope)."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "Qwen3Config":
        refuse_sliding_window(hf)
        return dataclasses.replace(super().from_hf(hf, context_window), qk_norm=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Same functions and KV cache as Llama; LlamaAttention applies q_norm and k_norm to the fused q/k/v
    projection before the KV cache's RoPE and attention (config.qk_norm)."""
