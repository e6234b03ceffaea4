"""The shapes people deploy, as one-layer (two for the Gemmas: a sliding and a global layer) config-only
checkpoints: every tensor shape, head layout, RoPE scaling and vocabulary of the real model, no weights."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
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


# Shapes bench/compile_memory.py writes besides SHAPES, left out of the compile matrix because its layers' shapes are
# there already: Llama-3.2-3B (hidden 3072 as Phi-3-mini, vocabulary and RoPE as Llama-3-8B, tied).
LARGER_SHAPES: dict[str, tuple[type, dict[str, Any]]] = {
    "llama-3.2-3b": (LlamaConfig, dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                                       num_key_value_heads=8, vocab_size=128256,
                                       tie_word_embeddings=True, max_position_embeddings=131072,
                                       rope_parameters={**_LLAMA3_ROPE, "factor": 32.0})),
}


# decoder layers of the released models (SHAPES' configs hold one or two); the Gemmas' layer patterns are left out
RELEASED_LAYERS = {"llama-2-7b": 32, "llama-3-8b": 32, "mistral-7b": 32, "qwen2.5-0.5b": 24, "qwen2.5-1.5b": 28,
                   "qwen2.5-3b": 36, "qwen2.5-7b": 28, "qwen3-0.6b": 28, "qwen3-1.7b": 28, "qwen3-4b": 36,
                   "qwen3-8b": 36, "phi-3-mini": 32, "smollm2-360m": 32, "smollm2-1.7b": 24, "llama-3.2-3b": 28}


def write_config(name: str, out_dir: Path) -> Path:
    """A directory holding only `name`'s config.json (one layer unless the shape says two)."""
    config_cls, sizes = SHAPES[name]
    config = config_cls(**{"num_hidden_layers": 1, **sizes})
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config.to_dict()))
    return out_dir


SHARD_BYTES = 4 << 30  # Hugging Face's own shard size for these models is 4-5 GB


def write_checkpoint(name: str, out_dir: Path, layers: int | None = None, seed: int = 0) -> Path:
    """`name`'s shape with `layers` decoder layers (default: the released model's count) as a random bf16
    safetensors checkpoint in shards of SHARD_BYTES, written tensor by tensor (one tensor in memory at a time):
    values normal(0, 0.02) from a generator per tensor, norms ones, and a tiny word tokenizer."""
    from compiler.models.registry import family_for  # pylint: disable=import-outside-toplevel

    from .tiny_tokenizer import save_tiny_tokenizer  # pylint: disable=import-outside-toplevel

    config_cls, sizes = (SHAPES | LARGER_SHAPES)[name]
    config = config_cls(**{**sizes, "num_hidden_layers": layers or RELEASED_LAYERS[name]}).to_dict()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config))
    save_tiny_tokenizer(out_dir)
    shapes = family_for(config).config_class.from_hf(config, None).source_shapes()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for tensor, shape in shapes.items():
        nbytes = 2 * int(np.prod(shape))
        if size and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((tensor, shape))
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(out_dir / file, shard, seed)
        weight_map |= dict.fromkeys((t for t, _ in shard), file)
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out_dir


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    """One safetensors file: its header, then each tensor's bf16 values as they are drawn."""
    header, offset = {}, 0
    for tensor, shape in tensors:
        nbytes = 2 * int(np.prod(shape))
        header[tensor] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for tensor, shape in tensors:
            rows = shape[0]
            step = max(1, (64 << 20) // max(1, 4 * int(np.prod(shape[1:]))))  # 64 MB of float32 at a time
            rng = np.random.default_rng([seed, zlib.crc32(tensor.encode())])
            for start in range(0, rows, step):
                if tensor.endswith("norm.weight"):
                    values = np.ones((min(step, rows - start), *shape[1:]), np.float32)
                else:
                    values = rng.standard_normal((min(step, rows - start), *shape[1:]), np.float32) * 0.02
                f.write((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())


def target_files(x86: bool | None = None) -> list[str]:
    """The target files whose CPU code is x86 (x86=True), the others (False), or all (None). `host` is left out: its
    code is this machine's CPU's, which x86-64-v3 (AVX2) or x86-64-v4 (AVX-512) builds already (CI's machines are one
    or the other)."""
    from compiler.target.targets import available_targets, load_target  # pylint: disable=import-outside-toplevel

    return [name for name in sorted(available_targets()) if name != "host"
            and (x86 is None or ("x86_64" in str(load_target(name).model_target().export().get("mtriple", ""))) == x86)]


def matrix(targets: list[str]) -> list:
    """pytest params (shape, target) of every shape on each of `targets`, where shape i compiles in the default set
    for one target file, all of them taking turns (target_files()[i % count]), and the rest of the matrix is
    `extended`: a shape that compiles for one target file compiles for the others but where one of them refuses an
    instruction choice or a device limit, which the extended set finds."""
    every = target_files()
    default = {(shape, every[i % len(every)]) for i, shape in enumerate(SHAPES)}
    return [pytest.param(shape, target, marks=() if (shape, target) in default else pytest.mark.extended)
            for shape in SHAPES for target in targets]


def check_compiles(name: str, target: str, tmp_path: Path) -> None:
    """Import `name`'s shape for `target` with the target's default scheme and generate its code (no weights:
    the kernels depend on the shapes alone); an error fails the test with the one line a user would see."""
    # imported here: the test modules that only list SHAPES need no TVM
    from compiler.codegen import hexagon, pipeline  # pylint: disable=import-outside-toplevel
    from compiler.model_import.importer import import_model, open_model  # pylint: disable=import-outside-toplevel
    from compiler.target.build_plan import resolve_plan  # pylint: disable=import-outside-toplevel

    plan = resolve_plan(target)
    with open_model(str(write_config(name, tmp_path / name)), weights_required=False) as ckpt:
        mod = import_model(ckpt, plan, None).mod
    if plan.spec.link["method"] == "hexagon":
        hexagon.build_kernels(pipeline.run_steps(mod, plan), plan.spec, tmp_path / "lib")
    else:
        pipeline.build(mod, plan)
