"""Qwen2 decoder: the Llama structure with biases on the q/k/v projections. Its config may ask for sliding-window
attention on the layers from max_window_layers on (use_sliding_window, off in released checkpoints; transformers 5
says it per layer in layer_types): sliding_layers.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import MobilecError
from .llama import LlamaConfig, LlamaForCausalLM
from .sliding_layers import (
    FULL,
    SLIDING,
    SlidingLayers,
    chunk_within_window,
    read_layer_types,
    sliding_attention_attrs,
    sliding_kv_cache_attention,
)


def qwen_sliding_layers(hf: dict[str, Any], base: LlamaConfig) -> dict[str, Any]:
    """SlidingLayers' fields of a Qwen2 / Qwen3 config, as transformers reads it: layer_types when given, else
    sliding from layer max_window_layers on where use_sliding_window; the prefill chunk within the window."""
    layers = base.num_hidden_layers

    def derive() -> list[str]:
        use = hf.get("use_sliding_window", False)
        if not isinstance(use, bool):
            raise MobilecError(f"config.json: use_sliding_window must be true or false, got {use!r}")
        first = hf.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise MobilecError(f"config.json: max_window_layers must be a whole number, at least 0, got {first!r}")
        return [SLIDING if use and hf.get("sliding_window") is not None and i >= first else FULL
                for i in range(layers)]

    types, window = read_layer_types(hf, layers, derive)
    return {"layer_types": types, "sliding_window": window,
            "prefill_chunk_size": chunk_within_window(base.prefill_chunk_size, window)}


@dataclasses.dataclass
class Qwen2Config(SlidingLayers, LlamaConfig):
    """Qwen2 configs carry no `attention_bias` flag: q/k/v always have biases, o_proj never."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "Qwen2Config":
        base = super().from_hf({**hf, "attention_bias": True, "attention_out_bias": False}, context_window)
        return dataclasses.replace(base, **qwen_sliding_layers(hf, base))


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama's functions and KV cache, with the sliding layers of use_sliding_window."""

    def attention_attrs(self) -> dict[str, Any]:
        return sliding_attention_attrs(self.cfg)

    def kv_cache_attention(self) -> dict[str, Any]:
        return sliding_kv_cache_attention(self.cfg, super().kv_cache_attention()["rope_mode"])
