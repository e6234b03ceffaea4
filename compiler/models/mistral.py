"""Mistral decoder: the Llama structure. A `sliding_window` (Mistral 7B v0.1: 4096; null from v0.2 on) shorter than
the context window is refused: compile with --context-window at most the window, where it changes nothing."""

from __future__ import annotations

from typing import Any

from ..errors import MobilecError
from .llama import LlamaConfig, LlamaForCausalLM, _whole


def binding_sliding_window(hf: dict[str, Any], context_window: int) -> int | None:
    """The config's `sliding_window` where it changes the model's math: a query attends to itself and the
    sliding_window - 1 positions before it, so in a context window of at most sliding_window tokens it is full
    attention, and None."""
    if hf.get("sliding_window") is None:
        return None
    window = _whole(hf, "sliding_window")
    return window if window < context_window else None


class MistralConfig(LlamaConfig):
    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "MistralConfig":
        """Llama's fields; a window that binds is refused: with every layer TVM's "mha_sliding" the cache fails at
        run time (a null tensor view in TVM 0.27's runtime), which Gemma's mixed layers do not hit."""
        cfg = super().from_hf(hf, context_window)
        window = binding_sliding_window(hf, cfg.context_window_size)
        if window is not None:
            raise MobilecError(f"config.json: sliding_window {window} is shorter than the context window "
                               f"{cfg.context_window_size}, which is not implemented for {hf.get('model_type')}; "
                               f"use --context-window {window} or less")
        return cfg


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's functions and KV cache (the window, at least the context window, changes nothing)."""
