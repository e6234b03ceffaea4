"""Seeded tiny random transformers models, written as HF directories and as GGUF files.

Every parameter (norms included) is drawn from a seeded normal distribution, so two loaders that agree on
these weights agree on layout, names and permutations, not just on ones and zeros.

    model = build_model("llama_gqa")
    save_hf(model, tmp / "hf")                      # model.safetensors + config.json
    save_hf(model, tmp / "bin", fmt="bin_sharded")  # pytorch_model-0000X-of-00002.bin + index
    write_gguf(model, tmp / "m.gguf")                # F32 tensors, llama.cpp names and q/k order
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from tests.helpers.tiny_tokenizer import save_tiny_tokenizer

# name -> (model class, config class, config kwargs)
SPECS: dict[str, tuple[type, type, dict[str, Any]]] = {
    # GQA (4 query heads share 2 kv heads) with tied embeddings, the SmolLM2 shape in miniature.
    "llama_gqa": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    # MHA, untied lm_head, and q/k/v/o biases: llama.cpp permutes the q/k biases too.
    "llama_mha_untied": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False, attention_bias=True),
    ),
    # Awkward sizes: vocab not a multiple of anything, hidden 72 = 4 heads x 18 (even, as RoPE needs).
    "llama_odd": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(vocab_size=32003, hidden_size=72, intermediate_size=136, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    # Qwen2: q/k/v biases, no o bias, and llama.cpp leaves its q/k rows unpermuted.
    "qwen2_bias": (
        Qwen2ForCausalLM,
        Qwen2Config,
        dict(vocab_size=192, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
}
_COMMON = dict(max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=50000.0)
# Llama 3.x RoPE scaling in miniature: with head_dim 16 and theta 5e4 the rotated pairs have wavelengths 6.3, 24,
# 94, 364, ... tokens; original_max_position_embeddings 32 leaves the first unscaled (below 32 / 4), smooths the
# second and divides the others' frequencies by 8, which a prompt of ~100 tokens shows.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# Models compiled by tests/test_architectures.py (longer prompts than test_tiny_models.py's, so not in SPECS).
ARCHITECTURE_SPECS: dict[str, tuple[type, type, dict[str, Any]]] = {
    # The llama_gqa shape with Llama 3.1/3.2's RoPE scaling.
    "llama3_rope": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    ),
    # Linear RoPE scaling (positions / factor), MHA, untied.
    "llama_linear_rope": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(vocab_size=176, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
             rope_parameters={"rope_type": "linear", "rope_theta": 50000.0, "factor": 4.0}),
    ),
    # Qwen3: q_norm / k_norm per head, head_dim 32 stated apart from hidden / heads = 16, tied embeddings (as
    # Qwen3-0.6B), no biases.
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config,
        dict(vocab_size=224, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
}

# Architectures with a test file of their own (tests/test_architectures_gemma.py), not in SPECS' loops (GGUF, profile).
GEMMA_SPECS: dict[str, tuple[type, type, dict[str, Any]]] = {
    # Gemma 3: sliding layers around a global one, a window of 8 (shorter than the tests' sequences), RoPE bases far
    # apart (10 vs 1000, linear factor 4 on the global layer) so that each matters within a short prompt,
    # query_pre_attn_scalar 24 != head_dim 16.
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                              "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0}},
             tie_word_embeddings=True, attn_implementation="eager"),
    ),
    # Gemma 2: alternating sliding (window 8) and global layers, attention scores capped at 20 and logits at 5,
    # small enough that both caps change the result of these random weights.
    "gemma2": (
        Gemma2ForCausalLM,
        Gemma2Config,
        dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
             attn_logit_softcapping=20.0, final_logit_softcapping=5.0, tie_word_embeddings=True,
             attn_implementation="eager"),
    ),
}

HF_FORMATS = ("safetensors", "safetensors_sharded", "bin", "bin_sharded")


def build_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **changes) -> PreTrainedModel:
    """A tiny random model from SPECS, ARCHITECTURE_SPECS or GEMMA_SPECS, with config `changes` (a negative
    control's twin, where they change no parameter's shape); the same (name, seed, changes) always gives the same
    weights."""
    model_cls, config_cls, kwargs = {**SPECS, **ARCHITECTURE_SPECS, **GEMMA_SPECS}[name]
    return random_model(model_cls, config_cls(**{**_COMMON, **kwargs, **changes}), seed, dtype)


def random_model(model_cls: type, config, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """`model_cls(config)` with every parameter drawn from N(0, 0.5^2) seeded by `seed`."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # tied weights are one parameter, so they stay tied
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model.to(dtype)


def state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of `model` holds: no lm_head when it is tied, as save_pretrained writes it."""
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def save_hf(model: PreTrainedModel, out_dir: str | Path, fmt: str = "safetensors") -> Path:
    """Write `model` as an HF directory in one of HF_FORMATS; the sharded ones have exactly two shards."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = state_dict(model)
    if fmt == "safetensors":
        model.save_pretrained(out)
        return out
    model.config.save_pretrained(out)
    names = list(sd)
    shards = [names[: len(names) // 2], names[len(names) // 2 :]] if fmt.endswith("_sharded") else [names]
    ext, stem = (".safetensors", "model") if fmt.startswith("safetensors") else (".bin", "pytorch_model")
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"{stem}{ext}" if len(shards) == 1 else f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}"
        tensors = {k: sd[k] for k in shard}
        if ext == ".safetensors":
            from safetensors.torch import save_file

            save_file(tensors, out / file, metadata={"format": "pt"})
        else:
            torch.save(tensors, out / file)
        weight_map.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / f"{stem}{ext}.index.json").write_text(json.dumps(index, indent=2))
    return out



def save_compilable_checkpoint(model: PreTrainedModel, out_dir: str | Path) -> Path:
    """An HF directory `mobilec compile` accepts: the model's safetensors and the tiny test tokenizer."""
    out = save_hf(model, out_dir)
    save_tiny_tokenizer(out)
    return out

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: HF q/k rows -> GGUF order (weights and biases)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's convert_hf_to_gguf.py writes for Llama 3 RoPE scaling (LlamaModel's
    generate_extra_tensors): per rotated pair, the divisor of its frequency, computed here independently of the
    loader's copy (compiler/loaders/gguf.py)."""
    import math

    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_char_tokenizer(w: gguf.GGUFWriter, vocab_size: int) -> None:
    """A character-level "gpt2" tokenizer padded to the vocabulary: enough for transformers to build one. One merge,
    "z z" -> "zz" (the last token): gguf's writer drops an empty merges list, and llama.cpp refuses a "gpt2"
    tokenizer without one ("cannot find tokenizer merges")."""
    tokens = ["<unk>", "</s>", " "] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens += [f"<x{i}>" for i in range(vocab_size - len(tokens) - 1)] + ["zz"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges(["z z"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(1)


def write_gguf(model: PreTrainedModel, path: str | Path, tokenizer: bool = False,
               quantize: Callable[[str, np.ndarray], tuple[gguf.GGMLQuantizationType, np.ndarray] | None] | None = None,
               chat_template: str | None = None) -> Path:
    """Write `model` as an F32 GGUF the way llama.cpp's converter lays it out (names, metadata, q/k order).

    With `tokenizer`, a character-level tokenizer is included (compiling needs one), with `chat_template` if
    given; tokenizer round trips of real vocabularies are tested on SmolLM2's GGUF.
    `quantize(gguf name, float data in the file's row order)`
    returns (ggml type, raw block bytes) for a tensor to store quantized, or None to keep it F32.
    """
    cfg = model.config
    arch = {"gemma3_text": "gemma3"}.get(cfg.model_type, cfg.model_type)
    gemma = arch in ("gemma2", "gemma3")
    gguf_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (llama.cpp fixes the sliding ones' base)
    rope_theta = getattr(cfg, "rope_theta", None) or rope["rope_theta"]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "phi3":  # as the converter (Phi3MiniModel) writes it: the rotated dims, the window (0: none)
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size)
                                   // cfg.num_attention_heads)
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings",
                                                 cfg.original_max_position_embeddings))
        w.add_sliding_window(cfg.sliding_window or 0)
    else:
        w.add_rope_dimension_count(head_dim)
    if gemma or head_dim != cfg.hidden_size // cfg.num_attention_heads:  # (the converter: from config.head_dim)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer:
        _add_char_tokenizer(w, cfg.vocab_size)
        if chat_template is not None:
            w.add_chat_template(chat_template)
    if rope.get("rope_type") == "linear":  # llama.cpp's converter writes linear scaling as metadata...
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "llama3":  # ...and Llama 3's as a tensor of per-pair factors
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_freqs(rope, head_dim))
    elif rope.get("rope_type") == "longrope":  # ...and Phi-3's LongRoPE as two tensors and its attention factor
        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        for key, tensor in (("long_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_LONG),
                            ("short_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)):
            w.add_tensor(gguf.TENSOR_NAMES[tensor] + ".weight", np.asarray(rope[key], np.float32))

    name_map = gguf.get_tensor_name_map(gguf_arch, cfg.num_hidden_layers)
    for hf_name, t in state_dict(model).items():
        data = t.to(torch.float32).numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        elif gemma and hf_name.endswith("norm.weight"):  # the converter stores Gemma's (1 + w) norms as 1 + w
            data = data + 1
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        stored = quantize(gguf_name, data) if quantize else None
        if stored is None:
            w.add_tensor(gguf_name, np.ascontiguousarray(data))
        else:
            w.add_tensor(gguf_name, stored[1], raw_dtype=stored[0])  # a uint8 byte shape: gguf derives the values
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
