"""GGUF files (llama.cpp's format): HF names, HF layout and an HF-style config from GGUF metadata.

The file is memory-mapped (gguf_file.py); tensors are dequantized one at a time on request.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf.quants import dequantize

from ..errors import MobilecError
from ..models.longrope import longrope_attention_factor
from .checkpoint import Checkpoint, Rows, one_line
from .gguf_file import GGUFFile, GGUFFormatError, GGUFTensor
from .tokenizer import save_auto_tokenizer

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's four norms a layer: llama.cpp names the one before the MLP ffn_norm (Llama's post-attention norm)
_GEMMA_BLOCK_NAMES = {**_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3's fused projections: q/k/v in one matrix, and ffn_up holding gate and up (transformers' gate_up_proj)
_PHI3_BLOCK_NAMES = {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# GGUF architecture -> HF model_type, where they differ; and Gemma's (llama.cpp stores its norm weights as 1 + w)
_MODEL_TYPES = {"gemma3": "gemma3_text"}
_GEMMA_ARCHS = {"gemma2", "gemma3"}
_ARCH_BLOCK_NAMES = {"gemma2": _GEMMA_BLOCK_NAMES, "gemma3": _GEMMA_BLOCK_NAMES, "phi3": _PHI3_BLOCK_NAMES}
# llama.cpp's scale of Gemma's attention scores: 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for the 27B models,
# which it recognises by their layer count (query_pre_attn_scalar is not in the file)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's convert script reorders q/k rows (see _unpermute_order) only for these architectures.
_PERMUTED_ARCHS = {"llama"}
# rope_freqs holds Llama 3 RoPE scaling factors, rope_factors_* Phi-3's LongRoPE ones: described by
# hf_config["rope_scaling"], not weights.
_ROPE_FREQS = "rope_freqs.weight"
_LONGROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
_NOT_WEIGHTS = {_ROPE_FREQS, *_LONGROPE_FACTORS.values()}


def _hf_name(gguf_name: str, arch: str) -> str:
    """HF name of a GGUF tensor of architecture `arch`; names with no HF counterpart are kept as they are."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{suffix}"
    m = _BLOCK_RE.fullmatch(gguf_name)
    names = _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return gguf_name


def _unpermute_order(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that turns llama.cpp's q/k rows back into HF's.

    llama.cpp interleaves the two rotate-half halves of each head (rows reshaped (heads, 2, d/2) -> (heads, d/2, 2));
    HF row i of a head is GGUF row `order[i]`, as in transformers' `_reverse_permute_weights`.
    """
    return np.arange(n_rows).reshape(n_head, n_rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def llama3_rope_freqs(theta: float, dims: int, factor: float, low: float, high: float, original: float) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for Llama 3 RoPE scaling, as its convert_hf_to_gguf.py computes it: per
    rotated pair i, the divisor of the frequency theta^(-2i/dims) (1 at high frequencies, factor at low ones,
    1 / ((1 - smooth) / factor + smooth) between, smooth = (original / wavelength - low) / (high - low))."""
    inv = 1.0 / theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelen = 2 * math.pi / inv
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def llama3_from_rope_freqs(factors: np.ndarray, theta: float, dims: int) -> dict[str, Any] | None:
    """HF's Llama 3 rope_scaling dict that reproduces llama.cpp's rope_freqs `factors` (llama3_rope_freqs); None
    when every factor is 1. The factors fix factor (the largest) and, per pair, the smoothing weight
    w = clamp(alpha f - beta, 0, 1) of its frequency f, alpha = original / (2 pi (high - low)), beta = low / (high
    - low): alpha and beta come from the pairs strictly between 1 and factor (Llama 3.1 8B has 6, 3.2 1B 3), or,
    with fewer, a line that reproduces every pair; low is set to 1, which fixes high and original. ValueError when
    no such scaling reproduces the factors."""
    if factors.shape != (dims // 2,):
        raise ValueError(f"rope_freqs has {factors.size} values for {dims} rotated dimensions ({dims // 2} expected)")
    if not np.all(np.isfinite(factors)) or factors.min() <= 0:
        raise ValueError("rope_freqs holds non-positive or non-finite factors")
    factor = float(factors.max())
    if np.allclose(factors, 1.0, rtol=1e-6, atol=0):
        return None
    f = 1.0 / theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    w = (1 / factors - 1 / factor) / (1 - 1 / factor)
    tol = 1e-5
    inner = (w > tol) & (w < 1 - tol)
    ones, zeros = f[w >= 1 - tol], f[w <= tol]  # unscaled (high-frequency) and fully scaled pairs
    if inner.sum() >= 2:
        alpha, intercept = np.polyfit(f[inner], w[inner], 1)
        beta = -intercept
    elif inner.sum() == 1:
        fj, wj = float(f[inner][0]), float(w[inner][0])
        slopes = [wj / (fj - zeros.max())] if zeros.size else []
        slopes += [(1 - wj) / (ones.min() - fj)] if ones.size else []
        alpha = max(slopes) if slopes else wj / fj
        beta = alpha * fj - wj
    elif ones.size and zeros.size:
        alpha = 1 / (ones.min() - zeros.max())
        beta = alpha * zeros.max()
    else:  # every pair divided by factor
        alpha, beta = 1 / (2 * f.max()), 1.0
    if not alpha > 0 or not beta > 0:
        raise ValueError("rope_freqs does not follow Llama 3's RoPE scaling, the only one mobilec reads from it")
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": float(1.0 + 1.0 / beta),
               "original_max_position_embeddings": float(2 * math.pi * alpha / beta)}
    for key in ("factor", "high_freq_factor", "original_max_position_embeddings"):
        nearest = round(scaling[key])
        if nearest and abs(scaling[key] - nearest) <= 1e-5 * nearest:
            scaling[key] = float(nearest)
    again = llama3_rope_freqs(theta, dims, *(scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                                   "original_max_position_embeddings")))
    if not np.allclose(again, factors, rtol=1e-4, atol=0):
        raise ValueError("rope_freqs does not follow Llama 3's RoPE scaling, the only one mobilec reads from it")
    return scaling


def _f32(value: Any) -> float:
    # GGUF stores eps/theta as float32: 1e-5 reads back as 9.999999747378752e-06; keep the value that was meant.
    return float(str(np.float32(value)))


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path):
        self._path = path
        try:
            self._reader = GGUFFile(path)
        except (GGUFFormatError, UnicodeDecodeError) as e:
            raise MobilecError(
                f"GGUF file {str(path)!r} is truncated or corrupt ({one_line(e)}); re-download or re-convert it"
            ) from e
        size = path.stat().st_size
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise MobilecError(
                    f"GGUF file {str(path)!r} is truncated (tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, "
                    f"file has {size}); re-download or re-convert it"
                )
        self._arch = self._field("general.architecture")
        if not isinstance(self._arch, str):
            raise MobilecError(f"GGUF file {str(path)!r} has no general.architecture; re-convert it with llama.cpp")
        self._tensors = {_hf_name(t.name, self._arch): t for t in self._reader.tensors if t.name not in _NOT_WEIGHTS}
        self.hf_config = self._config()
        self.description = f"GGUF {path.name} ({self._file_type()})"

    def _field(self, key: str, default: Any = None) -> Any:
        return self._reader.fields.get(key, default)

    def _config(self) -> dict[str, Any]:
        a = self._arch
        gguf_names = {t.name for t in self._reader.tensors}

        def need(key: str) -> Any:
            value = self._field(f"{a}.{key}")
            if value is None:
                raise MobilecError(f"GGUF file {str(self._path)!r} lacks metadata {a}.{key}; re-convert it with llama.cpp")
            return value

        hidden, heads, layers = (int(need("embedding_length")), int(need("attention.head_count")),
                                 int(need("block_count")))
        # llama.cpp's own default for the head size when key_length is absent; rope.dimension_count may be partial.
        head_dim = int(self._field(f"{a}.attention.key_length", hidden // heads if heads > 0 else 0))
        # Older converters omit vocab_size; then the tokenizer's token list has the count.
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None and f"{a}.vocab_size" not in self._reader.fields else None
        cfg: dict[str, Any] = {
            "model_type": _MODEL_TYPES.get(a, a),
            "vocab_size": int(vocab if vocab is not None else need("vocab_size")),
            "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
            "rope_theta": _f32(self._field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._field(f"{a}.context_length", 2048)),
            # Converters drop output.weight exactly when the model ties it to the embedding.
            "tie_word_embeddings": "output.weight" not in gguf_names,
            "attention_bias": "blk.0.attn_q.bias" in gguf_names,
        }
        if a in _GEMMA_ARCHS:
            cfg.update(self._gemma_fields(hidden, heads, head_dim, layers))
        if a == "phi3":
            cfg.update(self._phi3_fields(cfg["max_position_embeddings"]))
        experts = self._field(f"{a}.expert_count")
        if experts:  # llama.cpp stores Mixtral-style models under the llama architecture, with experts
            cfg["num_local_experts"] = int(experts)
        rope_dims = self._field(f"{a}.rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            cfg["partial_rotary_factor"] = int(rope_dims) / head_dim
        rope_scaling = self._rope_scaling(gguf_names)
        if rope_scaling:
            cfg["rope_scaling"] = rope_scaling
        for gguf_key, hf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
            token_id = self._field(f"tokenizer.ggml.{gguf_key}_token_id")
            if token_id is not None:
                cfg[hf_key] = int(token_id)
        return cfg

    def _gemma_fields(self, hidden: int, heads: int, head_dim: int, layers: int) -> dict[str, Any]:
        """What Gemma's config needs beyond Llama's: the window, the score scale and (Gemma 2) the caps, as llama.cpp
        reads them (its defaults where the file has none; the layer pattern and the sliding layers' RoPE base are
        the HF configs' defaults, which llama.cpp hard-codes too)."""
        a = self._arch
        fields: dict[str, Any] = {"sliding_window": int(self._field(f"{a}.attention.sliding_window", 4096)),
                                  "query_pre_attn_scalar": float(head_dim)}
        if layers == _GEMMA_27B_LAYERS[a]:
            fields["query_pre_attn_scalar"] = float(hidden // heads)
        if a == "gemma2":
            fields["attn_logit_softcapping"] = _f32(self._field(f"{a}.attn_logit_softcapping", 50.0))
            fields["final_logit_softcapping"] = _f32(self._field(f"{a}.final_logit_softcapping", 30.0))
        return fields

    def _phi3_fields(self, max_positions: int) -> dict[str, Any]:
        """Phi-3's window (0, Phi-4's, is none; llama.cpp ignores every Phi window, transformers applies it, and so
        does mobilec) and LongRoPE, whose factors llama.cpp's converter stores as two tensors and whose attention
        factor it writes as metadata: refused unless it is the one transformers (and mobilec) derive."""
        window = int(self._field("phi3.attention.sliding_window", 0))
        fields: dict[str, Any] = {"sliding_window": window or None}
        original = self._field("phi3.rope.scaling.original_context_length")
        if original is not None:
            fields["original_max_position_embeddings"] = int(original)
        names = {t.name: t for t in self._reader.tensors}
        present = [key for key, name in _LONGROPE_FACTORS.items() if name in names]
        if not present:
            return fields
        if len(present) != 2 or original is None:
            raise MobilecError(f"GGUF file {str(self._path)!r}: LongRoPE needs rope_factors_short, rope_factors_long "
                               f"and phi3.rope.scaling.original_context_length; re-convert it with llama.cpp")
        scaling: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": int(original)}
        for key, name in _LONGROPE_FACTORS.items():
            t = names[name]
            scaling[key] = [_f32(v) for v in np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(-1)]
        derived = longrope_attention_factor(max_positions / int(original), int(original))
        stored = self._field("phi3.rope.scaling.attn_factor")
        if stored is not None and not math.isclose(float(stored), derived, rel_tol=1e-6):
            raise MobilecError(f"GGUF file {str(self._path)!r}: LongRoPE attention factor {float(stored)} is not the "
                               f"{derived:.6f} that phi3.context_length / original_context_length gives; mobilec "
                               f"derives it and implements no other")
        fields["rope_scaling"] = scaling
        return fields

    def _rope_scaling(self, gguf_names: set[str]) -> dict[str, Any] | None:
        """RoPE scaling as HF's rope_scaling dict (the model's config implements it or refuses it in one line)."""
        a = self._arch
        kind = self._field(f"{a}.rope.scaling.type")
        if kind not in (None, "none"):
            scaling: dict[str, Any] = {"rope_type": kind}
            factor = self._field(f"{a}.rope.scaling.factor")
            if factor is not None:
                scaling["factor"] = _f32(factor)
            original = self._field(f"{a}.rope.scaling.original_context_length")
            if original is not None:
                scaling["original_max_position_embeddings"] = int(original)
            return scaling
        if _ROPE_FREQS in gguf_names:
            # llama.cpp bakes Llama 3 scaling into per-dimension factors and drops its parameters: recover them
            t = next(t for t in self._reader.tensors if t.name == _ROPE_FREQS)
            factors = np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
            a_cfg = {k: self._field(f"{a}.{k}") for k in ("rope.freq_base", "rope.dimension_count")}
            theta = _f32(a_cfg["rope.freq_base"] if a_cfg["rope.freq_base"] is not None else 10000.0)
            dims = int(a_cfg["rope.dimension_count"] or 2 * factors.size)
            try:
                return llama3_from_rope_freqs(factors, theta, dims)
            except ValueError as e:
                raise MobilecError(f"GGUF file {str(self._path)!r}: {e}") from None
        return None

    def _file_type(self) -> str:
        file_type = self._field("general.file_type")
        if file_type is not None:
            try:
                return re.sub(r"^(MOSTLY|ALL)_", "", LlamaFileType(int(file_type)).name)
            except ValueError:
                pass  # a newer llama.cpp file type: describe the tensors instead
        matrices = [t.tensor_type.name for t in self._reader.tensors if len(t.shape) >= 2]
        return Counter(matrices).most_common(1)[0][0] if matrices else "unknown"

    def _tensor(self, name: str) -> GGUFTensor:
        t = self._tensors.get(name)
        if t is None:
            raise self._missing(name)
        return t

    def _row_order(self, name: str, n_rows: int) -> np.ndarray | None:
        """HF row order of a q/k weight or bias stored permuted by llama.cpp; None for every other tensor."""
        if self._arch not in _PERMUTED_ARCHS or ".self_attn." not in name:
            return None
        if ".q_proj." in name:
            n_head = self.hf_config["num_attention_heads"]
        elif ".k_proj." in name:
            n_head = self.hf_config["num_key_value_heads"]
        else:
            return None
        if n_rows % (2 * n_head):
            raise MobilecError(
                f"{name} has {n_rows} rows, not a multiple of 2 x {n_head} heads; the GGUF metadata is inconsistent"
            )
        return _unpermute_order(n_rows, n_head)

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensor(name).shape))  # ggml lists dimensions innermost first

    def get(self, name: str) -> np.ndarray:
        t = self._tensor(name)
        values = self._dequantized(name, t, t.data)
        order = self._row_order(name, values.shape[0])
        if order is not None:
            values = values[order]
        if self._arch in _GEMMA_ARCHS and name.endswith("norm.weight"):
            values = values - 1  # llama.cpp's converter stores Gemma's (1 + w) RMSNorm weights as 1 + w
        # np.require copies views of the read-only mapping, so callers get an array they own.
        return np.require(values, np.float32, ["C", "W", "O"])

    def rows(self, name: str) -> np.ndarray | Rows:
        t = self._tensor(name)
        if len(t.shape) != 2 or self._row_order(name, int(t.shape[1])) is not None:
            return self.get(name)
        return Rows(self.shape(name), lambda rows: np.require(self._dequantized(name, t, t.data[rows]), np.float32,
                                                                ["C", "W", "O"]))

    def _dequantized(self, name: str, t: GGUFTensor, data: np.ndarray) -> np.ndarray:
        """`data` (rows of tensor `name`'s blocks, t) as float values; the map's pages read before are given back first
        (gguf_file.GGUFFile.release)."""
        self._reader.release()
        try:
            return dequantize(data, t.tensor_type)
        except NotImplementedError as e:
            raise MobilecError(
                f"{name} is stored as {t.tensor_type.name}, which cannot be dequantized; "
                "use a GGUF quantized as Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, F16 or F32"
            ) from e

    def get_gguf_blocks(self, name: str) -> tuple[str, np.ndarray, tuple[int, int]]:
        """(ggml type name, raw bytes [rows, bytes_per_row], (rows, cols)); q/k rows put in HF order.

        Only whole rows move, so every quantization block along K is untouched. The array may be a
        read-only view of the file. A 1-D tensor is one row.
        """
        t = self._tensor(name)
        self._reader.release()
        cols = int(t.shape[0])  # ggml lists dimensions innermost first
        rows = int(np.prod(t.shape[1:], dtype=np.int64))
        raw = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        is_vector = len(t.shape) == 1
        order = self._row_order(name, cols if is_vector else rows)
        if order is not None:
            if not is_vector:
                raw = raw[order]
            else:  # a q/k bias: its elements move, which only works for unblocked types
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.tensor_type)]
                if block != 1:
                    raise MobilecError(f"{name} is a {t.tensor_type.name} bias; re-convert the GGUF with F32 biases")
                raw = raw.reshape(cols, type_size)[order].reshape(1, -1)
        return t.tensor_type.name, raw, (rows, cols)

    def save_tokenizer(self, out_dir: str | os.PathLike) -> None:
        if "tokenizer.ggml.model" not in self._reader.fields:
            raise MobilecError(f"{self.description} carries no tokenizer; use a GGUF converted with its tokenizer")
        # transformers converts the vocabulary from the tokenizer fields, with a class chosen by the architecture
        read = {k: v for k, v in self._reader.fields.items()
                if k.startswith("tokenizer.") or k == "general.architecture"}
        save_auto_tokenizer(self._path.parent, out_dir, self.description, cache_key=json.dumps(read, sort_keys=True),
                            gguf_file=self._path.name)

    def close(self) -> None:
        # Dropping the reader drops its memory map; returned arrays own their data (see get).
        self._tensors = {}
        self._reader = None
