"""Quantization schemes by name: how weights are stored, and which dtype the model computes in."""

from __future__ import annotations

import dataclasses

from ..errors import MobilecError
from .group import GroupLayout


@dataclasses.dataclass(frozen=True)
class Scheme:
    """kind "float": the whole model in `float_dtype`. kind "group": linear and embedding weights in `layout`,
    activations in the target's compute dtype. kind "gguf": each GGUF tensor keeps its own block format."""

    name: str
    kind: str
    float_dtype: str | None = None
    layout: GroupLayout | None = None

    def describe(self) -> str:
        if self.kind == "float":
            return f"no quantization, {self.float_dtype} weights and activations"
        if self.kind == "gguf":
            return ("keep a GGUF file's values bit for bit (GGUF input only): Q4_0/Q4_1/Q8_0 blocks as stored; "
                    "Q4_K/Q5_K/Q6_K with float32 scales per sub-block, 6/10/10 bits per weight instead of 4.5/5.5/6.6")
        return f"{self.layout.describe()} (embedding and lm_head: int8, group 32)"

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "float_dtype": self.float_dtype,
                "layout": dataclasses.asdict(self.layout) if self.layout else None, "description": self.describe()}


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("q0f32", "float", float_dtype="float32"),
        Scheme("q0f16", "float", float_dtype="float16"),
        Scheme("q4f16_g32", "group", layout=GroupLayout(4, 32, True, "float16")),
        Scheme("q4f16_g128", "group", layout=GroupLayout(4, 128, True, "float16")),
        Scheme("q4f32_g32", "group", layout=GroupLayout(4, 32, True, "float32")),
        Scheme("q4f16_g32_asym", "group", layout=GroupLayout(4, 32, False, "float16")),
        Scheme("q8f16_g128", "group", layout=GroupLayout(8, 128, True, "float16")),
        Scheme("gguf", "gguf"),
    )
}


def get_scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise MobilecError(f"unknown quantization {name!r}; valid: {', '.join(SCHEMES)}")
    return SCHEMES[name]


def schemes_help() -> str:
    return "; ".join(f"{s.name}: {s.describe()}" for s in SCHEMES.values())
