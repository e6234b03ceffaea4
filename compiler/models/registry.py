"""Model families keyed on the Hugging Face `model_type`."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..choices import MODEL_TYPES
from ..errors import MobilecError
from .gemma import Gemma2Config, Gemma3TextConfig, GemmaForCausalLM
from .llama import LlamaConfig, LlamaForCausalLM
from .mistral import MistralConfig, MistralForCausalLM
from .phi3 import Phi3Config, Phi3ForCausalLM
from .qwen2 import Qwen2Config, Qwen2ForCausalLM
from .qwen3 import Qwen3Config, Qwen3ForCausalLM


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    config_class: type[LlamaConfig]
    model_class: type[LlamaForCausalLM]


FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily("llama", LlamaConfig, LlamaForCausalLM),
    "qwen2": ModelFamily("qwen2", Qwen2Config, Qwen2ForCausalLM),
    "qwen3": ModelFamily("qwen3", Qwen3Config, Qwen3ForCausalLM),
    "gemma3_text": ModelFamily("gemma3_text", Gemma3TextConfig, GemmaForCausalLM),
    "gemma2": ModelFamily("gemma2", Gemma2Config, GemmaForCausalLM),
    "mistral": ModelFamily("mistral", MistralConfig, MistralForCausalLM),
    "phi3": ModelFamily("phi3", Phi3Config, Phi3ForCausalLM),
}
assert set(FAMILIES) == set(MODEL_TYPES), "compiler/choices.py MODEL_TYPES lists what the CLI offers"


def family_for(hf_config: dict[str, Any]) -> ModelFamily:
    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise MobilecError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
