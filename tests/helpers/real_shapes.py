"""The shapes people deploy, as one-layer (two for the Gemmas: a sliding and a global layer) config-only
checkpoints: every tensor shape, head layout, RoPE scaling and vocabulary of the real model, no weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                          Qwen3Config)

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
_TWO_GEMMA3_LAYERS = ["sliding_attention", "full_attention"]


def _qwen2(hidden, inter, heads, kv, vocab, tied):
    return Qwen2Config, dict(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                             num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied,
                             max_position_embeddings=32768, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1000000.0})


def _qwen3(hidden, inter, heads, vocab, tied):
    return Qwen3Config, dict(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                             num_key_value_heads=8, head_dim=128, vocab_size=vocab, tie_word_embeddings=tied,
                             max_position_embeddings=40960)


def _smollm2(hidden, inter, heads, kv):
    return LlamaConfig, dict(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                             num_key_value_heads=kv, vocab_size=49152, tie_word_embeddings=True,
                             max_position_embeddings=8192)


# name -> (config class, the released model's sizes)
SHAPES: dict[str, tuple[type, dict[str, Any]]] = {
    "llama-2-7b": (LlamaConfig, dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                     num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)),
    "llama-3-8b": (LlamaConfig, dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                                     rope_parameters=_LLAMA3_ROPE)),
    "mistral-7b": (MistralConfig, dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                       num_key_value_heads=8, vocab_size=32768, sliding_window=None,
                                       max_position_embeddings=32768)),
    "qwen2.5-0.5b": _qwen2(896, 4864, 14, 2, 151936, True),
    "qwen2.5-1.5b": _qwen2(1536, 8960, 12, 2, 151936, True),
    "qwen2.5-3b": _qwen2(2048, 11008, 16, 2, 151936, True),
    "qwen2.5-7b": _qwen2(3584, 18944, 28, 4, 152064, False),
    "qwen3-0.6b": _qwen3(1024, 3072, 16, 151936, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 16, 151936, True),
    "qwen3-4b": _qwen3(2560, 9728, 32, 151936, True),
    "qwen3-8b": _qwen3(4096, 12288, 32, 151936, False),
    "gemma-2-2b": (Gemma2Config, dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                                      num_key_value_heads=4, head_dim=256, vocab_size=256000, sliding_window=4096,
                                      query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                      final_logit_softcapping=30.0, num_hidden_layers=2)),
    "gemma-3-1b": (Gemma3TextConfig, dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
                                          num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
                                          query_pre_attn_scalar=256, max_position_embeddings=32768,
                                          layer_types=_TWO_GEMMA3_LAYERS, rope_parameters=_GEMMA3_ROPE,
                                          num_hidden_layers=2)),
    "gemma-3-4b": (Gemma3TextConfig, dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                                          num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024,
                                          query_pre_attn_scalar=256, max_position_embeddings=131072,
                                          layer_types=_TWO_GEMMA3_LAYERS, rope_parameters=_GEMMA3_ROPE,
                                          num_hidden_layers=2)),
    "phi-3-mini": (Phi3Config, dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                                    num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096)),
    "smollm2-360m": _smollm2(960, 2560, 15, 5),
    "smollm2-1.7b": _smollm2(2048, 8192, 32, 32),
}


def write_config(name: str, out_dir: Path) -> Path:
    """A directory holding only `name`'s config.json (one layer unless the shape says two)."""
    config_cls, sizes = SHAPES[name]
    config = config_cls(**{"num_hidden_layers": 1, **sizes})
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config.to_dict()))
    return out_dir


def target_files(x86: bool) -> list[str]:
    """The target files whose CPU code is x86, or the others. `host` is left out: its code is this machine's CPU's,
    which x86-64-v3 (AVX2) or x86-64-v4 (AVX-512) builds already (CI's machines are one or the other)."""
    from compiler.targets import available_targets, load_target  # pylint: disable=import-outside-toplevel

    return [name for name in sorted(available_targets()) if name != "host"
            and ("x86_64" in str(load_target(name).model_target().export().get("mtriple", ""))) == x86]


def check_compiles(name: str, target: str, tmp_path: Path) -> None:
    """Import `name`'s shape for `target` with the target's default scheme and generate its code (no weights:
    the kernels depend on the shapes alone); an error fails the test with the one line a user would see."""
    # imported here: the test modules that only list SHAPES need no TVM
    from compiler import hexagon, pipeline  # pylint: disable=import-outside-toplevel
    from compiler.importer import import_model, open_model, scheme_for  # pylint: disable=import-outside-toplevel
    from compiler.targets import load_target  # pylint: disable=import-outside-toplevel

    spec = load_target(target)
    with open_model(str(write_config(name, tmp_path / name)), weights_required=False) as ckpt:
        mod = import_model(ckpt, scheme_for(spec, None), spec, None).mod
    if spec.link["method"] == "hexagon":
        hexagon.build_kernels(pipeline.run_steps(mod, spec), spec, tmp_path / "lib")
    else:
        pipeline.build(mod, spec)
