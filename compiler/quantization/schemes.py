"""Quantization schemes by name: what each stores per weight and in which dtype the model computes."""

from __future__ import annotations

import dataclasses

from ..errors import MobilecError


@dataclasses.dataclass(frozen=True)
class Scheme:
    name: str
    model_dtype: str  # activations, norms, KV cache
    weight_bits: int  # 32/16 for float schemes
    description: str


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("q0f32", "float32", 32, "no quantization; float32 weights and activations"),
        Scheme("q0f16", "float16", 16, "no quantization; float16 weights and activations"),
    )
}


def get_scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise MobilecError(f"unknown quantization {name!r}; valid: {', '.join(SCHEMES)}")
    return SCHEMES[name]


def schemes_help() -> str:
    return "; ".join(f"{s.name}: {s.description}" for s in SCHEMES.values())
