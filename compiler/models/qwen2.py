"""Qwen2 decoder: the Llama structure with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from ..errors import MobilecError
from .llama import LlamaConfig, LlamaForCausalLM


class Qwen2Config(LlamaConfig):
    """Qwen2 configs carry no `attention_bias` flag: q/k/v always have biases, o_proj never."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "Qwen2Config":
        if hf.get("use_sliding_window"):
            raise MobilecError("Qwen2 sliding-window attention is not supported yet; set use_sliding_window=false")
        return super().from_hf({**hf, "attention_bias": True, "attention_out_bias": False}, context_window)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same functions and KV cache as Llama; only the config differs."""
