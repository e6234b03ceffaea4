"""LongRoPE (Phi-3's rope type "longrope", "su" in older configs), apart from the model so that the GGUF loader can
check a file's attention factor without importing TVM."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class LongRope:
    """Per-frequency divisors of the RoPE frequencies, one set for sequences within original_max_position_embeddings
    (short) and one beyond (long), and cos/sin scaled by longrope_attention_factor throughout."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    factor: float  # the extension: max_position_embeddings / original_max_position_embeddings unless given


def longrope_attention_factor(factor: float, original: int) -> float:
    """sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), 1 without an extension: transformers' and
    llama.cpp's converter's."""
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
