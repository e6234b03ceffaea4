"""Mistral decoder: the Llama structure. A `sliding_window` (Mistral 7B v0.1: 4096; null from v0.2 on; Phi-3-mini
2047) shorter than the context window is applied by mobilec's attention kernels (CPU and GPU) (SLIDING_WINDOW_ATTR): the
layers stay full attention to TVM's cache, which keeps every key, and the kernels see only the window's."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..kernels.cpu_attention import SLIDING_WINDOW_ATTR
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
    sliding_window: int = 0  # the window where it binds (binding_sliding_window), else 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "MistralConfig":
        """Llama's fields and the window where it binds. TVM's cache fails at run time with every layer
        "mha_sliding" (a null tensor view in TVM 0.27's runtime), so the window is not declared to it."""
        cfg = super().from_hf(hf, context_window)
        return dataclasses.replace(cfg, sliding_window=binding_sliding_window(hf, cfg.context_window_size) or 0)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's functions and KV cache; a binding window is mobilec's attention kernels' (SLIDING_WINDOW_ATTR)."""

    def attention_attrs(self) -> dict[str, Any]:
        return {SLIDING_WINDOW_ATTR: self.cfg.sliding_window} if self.cfg.sliding_window else {}
