"""Mistral decoder: the Llama structure, with attention limited to the last `sliding_window` tokens when the config
sets one (Mistral 7B v0.1: 4096; null from v0.2 on)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..kernels.cpu_attention import LAYER_SLIDING_WINDOW_ATTR
from .llama import LlamaConfig, LlamaForCausalLM, _whole


def binding_sliding_window(hf: dict[str, Any], context_window: int) -> int | None:
    """The config's `sliding_window` where it changes the model's math: a query attends to itself and the
    sliding_window - 1 positions before it, so in a context window of at most sliding_window tokens it is full
    attention, and None."""
    if hf.get("sliding_window") is None:
        return None
    window = _whole(hf, "sliding_window")
    return window if window < context_window else None


@dataclasses.dataclass
class MistralConfig(LlamaConfig):
    # every layer attends to the last sliding_window positions only (itself included); None: to all of them
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "MistralConfig":
        """Llama's fields and the binding window; prompts go in chunks of at most the window, as TVM's cache
        computes the new tokens among themselves without it (one ragged kernel for all layers)."""
        cfg = super().from_hf(hf, context_window)
        window = binding_sliding_window(hf, cfg.context_window_size)
        if window is None:
            return cfg
        return dataclasses.replace(cfg, sliding_window=window,
                                   prefill_chunk_size=min(cfg.prefill_chunk_size, window))


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's functions; with a binding window every layer is "mha_sliding": the cache hands its kernels the
    window's pages, and mobilec's CPU attention kernels take the window (LAYER_SLIDING_WINDOW_ATTR)."""

    def cpu_attention_attrs(self) -> dict[str, Any]:
        window = self.cfg.sliding_window
        return {} if window is None else {LAYER_SLIDING_WINDOW_ATTR: window}

    def kv_cache_attention(self) -> dict[str, Any]:
        attention = super().kv_cache_attention()
        window = self.cfg.sliding_window
        if window is None:
            return attention
        return {**attention, "attn_kind": ["mha_sliding"] * self.cfg.num_hidden_layers,
                "layer_sliding_window_size": window}
