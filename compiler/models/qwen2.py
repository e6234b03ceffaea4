"""Qwen2 decoder: the Llama structure with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from ..errors import MobilecError
from .llama import LlamaConfig, LlamaForCausalLM


def refuse_sliding_window(hf: dict[str, Any]) -> None:
    """Qwen2 and Qwen3 configs can ask for sliding-window attention on some layers (use_sliding_window, or
    transformers 5's layer_types); released checkpoints set it off, and mobilec implements full attention only."""
    if hf.get("use_sliding_window"):
        raise MobilecError("config.json: use_sliding_window=true (Qwen sliding-window attention) is not "
                           "implemented yet; set use_sliding_window=false")
    layer_types = hf.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise MobilecError(f"config.json: layer_types must be a list of attention kinds, got {layer_types!r}")
    sliding = sorted({str(kind) for kind in layer_types if kind != "full_attention"})
    if sliding:  # transformers 5 says per layer
        raise MobilecError(f"config.json: layer_types has {sliding[0]!r} layers, which mobilec does not "
                           "implement (full attention only)")


class Qwen2Config(LlamaConfig):
    """Qwen2 configs carry no `attention_bias` flag: q/k/v always have biases, o_proj never."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "Qwen2Config":
        refuse_sliding_window(hf)
        return super().from_hf({**hf, "attention_bias": True, "attention_out_bias": False}, context_window)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same functions and KV cache as Llama; only the config differs."""
