"""Phi-3 decoder (Phi-3-mini, Phi-3.5-mini, Phi-4-mini): the Llama structure, with q/k/v and gate/up fused in the
checkpoint, RoPE on the first `partial_rotary_factor` of each head, LongRoPE scaling, and a sliding window (Phi-3-mini:
2047) applied by mobilec's attention kernels where it binds (as Mistral's)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..errors import MobilecError
from .llama import _whole
from .longrope import LongRope, longrope_attention_factor
from .mistral import MistralConfig, MistralForCausalLM
from .rotary import RotaryEmbedding


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings: rope_scaling (transformers 4) or rope_parameters (transformers 5, rope_theta and
    partial_rotary_factor inside), {} when neither."""
    for key in ("rope_scaling", "rope_parameters"):
        fields = hf.get(key)
        if fields is None:
            continue
        if not isinstance(fields, dict):
            raise MobilecError(f"config.json: {key} must be a dictionary, got {fields!r}")
        return fields
    return {}


def _factors(rope: dict[str, Any], key: str, count: int) -> tuple[float, ...]:
    values = rope.get(key)
    if (not isinstance(values, list) or len(values) != count
            or not all(isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf for v in values)):
        raise MobilecError(f"config.json: rope_scaling {key} must be {count} positive numbers (rotary_dim / 2), "
                           f"got {values!r}")
    return tuple(float(v) for v in values)


@dataclasses.dataclass
class Phi3Config(MistralConfig):
    rotary_dim: int = 0  # the leading dims of each head that RoPE rotates
    longrope: LongRope | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "Phi3Config":
        rope = _rope_fields(hf)
        kind = rope.get("rope_type", rope.get("type"))
        if kind not in (None, "default", "longrope", "su"):
            raise MobilecError(f"config.json: RoPE scaling {kind!r} is not implemented for phi3 (longrope only)")
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if isinstance(partial, bool) or not isinstance(partial, int | float) or not 0 < partial <= 1:
            raise MobilecError(f"config.json: partial_rotary_factor must be in (0, 1], got {partial!r}")
        # Llama's checks and fields, with the RoPE settings handled here taken out
        plain = {**hf, "rope_scaling": None, "partial_rotary_factor": None,
                 "rope_parameters": {"rope_theta": rope["rope_theta"]} if "rope_theta" in rope else None}
        cfg = super().from_hf(plain, context_window)
        rotary_dim = int(cfg.head_dim * partial)  # as transformers rounds it
        if rotary_dim < 2 or rotary_dim % 2:
            raise MobilecError(f"config.json: partial_rotary_factor {partial!r} of head_dim {cfg.head_dim} rotates "
                               f"{rotary_dim} dims; RoPE rotates pairs, so it must be a positive even number")
        longrope = None
        if kind in ("longrope", "su"):
            longrope = _longrope(hf, rope, rotary_dim, cfg.max_position_embeddings)
        return dataclasses.replace(cfg, rotary_dim=rotary_dim, longrope=longrope)

    def rotary_in_model(self) -> RotaryEmbedding:
        """RoPE over rotary_dim dims; with LongRoPE, its attention factor and one set of factors for every position,
        chosen by the context window as llama.cpp chooses them by its context: the short ones within
        original_max_position_embeddings, the long ones past it. (transformers picks them by the length of the
        sequence at each forward call, so a sequence that grows past the original context has its first keys
        rotated with the short factors and the rest with the long ones: no fixed RoPE reproduces that; one
        processed whole, longer than the original context, gets the long factors as here.) TVM's cache takes a
        rotary_dim, but its LongRoPE kernel does not build in TVM 0.27: the model applies it all."""
        if self.longrope is None:
            return RotaryEmbedding.of_base(self.rope_theta, self.rotary_dim)
        original = self.longrope.original_max_position_embeddings
        scale = longrope_attention_factor(self.longrope.factor, original)
        factors = self.longrope.long_factor if self.context_window_size > original else self.longrope.short_factor
        return RotaryEmbedding.of_base(self.rope_theta, self.rotary_dim, factors, scale)

    def source_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().source_shapes()  # Llama's unfused q/k/v and gate/up are not among the sources: left out
        qkv = (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
        for i in range(self.num_hidden_layers):
            shapes[f"model.layers.{i}.self_attn.qkv_proj.weight"] = (qkv, self.hidden_size)
            shapes[f"model.layers.{i}.mlp.gate_up_proj.weight"] = (2 * self.intermediate_size, self.hidden_size)
        return shapes

    def param_sources(self) -> dict[str, list[str]]:
        """Llama's, with qkv_proj and gate_up_proj read as they are: the checkpoint fuses them in our row order
        (q, k, v; gate, up, as transformers' Phi3 splits them)."""
        fused = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")
        return {ours: [ours] if ours.endswith(fused) else names for ours, names in super().param_sources().items()}


def _longrope(hf: dict[str, Any], rope: dict[str, Any], rotary_dim: int, max_pos: int) -> LongRope:
    if rope.get("attention_factor") is not None:
        raise MobilecError("config.json: rope_scaling attention_factor is not implemented (mobilec derives it from "
                           "factor, as transformers does when it is absent)")
    original = _whole({"original_max_position_embeddings": rope.get(
        "original_max_position_embeddings", hf.get("original_max_position_embeddings"))},
        "original_max_position_embeddings")
    factor = rope.get("factor")
    factor = max_pos / original if factor is None else factor
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor < math.inf:
        raise MobilecError(f"config.json: rope_scaling factor must be a positive number, got {factor!r}")
    return LongRope(short_factor=_factors(rope, "short_factor", rotary_dim // 2),
                    long_factor=_factors(rope, "long_factor", rotary_dim // 2),
                    original_max_position_embeddings=original, factor=float(factor))


class Phi3ForCausalLM(MistralForCausalLM):
    """Llama's functions and KV cache; the config's rotary_in_model makes the model apply RoPE."""
