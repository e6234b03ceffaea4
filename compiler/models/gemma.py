"""Gemma 3 (text) and Gemma 2 decoders in Relax's nn frontend, with TVM's paged KV cache.

What differs from Llama (transformers' modeling_gemma3.py / modeling_gemma2.py): the embedding is scaled by
sqrt(hidden_size) in the activations' dtype; every RMSNorm multiplies by (1 + weight), in float32; the attention and
the MLP each sit between a pre- and a post-norm; the MLP is gelu_tanh(gate) * up; the softmax scale is
1 / sqrt(query_pre_attn_scalar); layers alternate sliding-window and global attention. Gemma 3 adds q/k RMSNorms per
head before RoPE and a RoPE base of its own for the sliding layers (linear scaling on the global ones only); Gemma 2
caps the attention scores (attn_logit_softcapping, in mobilec's CPU and GPU attention kernels) and the final logits with
cap * tanh(x / cap).

RoPE bases that differ per layer are not something TVM's paged cache does (one rope_theta): the cache runs with
RopeMode.NONE and RoPE is applied here, before q/k/v enter it, at the positions the cache reports."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode

from ..errors import MobilecError
from ..kernels.cpu_attention import ATTN_LOGIT_CAP_ATTR
from .llama import Embedding, LlamaAttention, LlamaConfig, LlamaForCausalLM, _positive, _whole
from .rotary import RotaryEmbedding
from .sliding_layers import (
    FULL,
    SLIDING,
    SlidingLayers,
    chunk_within_window,
    read_layer_types,
    sliding_attention_attrs,
    sliding_kv_cache_attention,
)

GELU_TANH = "gelu_pytorch_tanh"


@dataclasses.dataclass
class GemmaConfig(SlidingLayers, LlamaConfig):
    """LlamaConfig's fields (rope_theta: the global layers' base), the sliding layers' and Gemma's own."""

    query_pre_attn_scalar: float = 256.0
    rope_local_theta: float = 10000.0  # RoPE base of the sliding layers
    rope_global_factor: float = 1.0  # linear RoPE scaling of the global layers (positions / factor)
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    def rope(self, layer_id: int) -> tuple[float, float]:
        """(base, linear scaling factor) of layer `layer_id`'s RoPE."""
        if self.layer_types[layer_id] == SLIDING:
            return self.rope_local_theta, 1.0
        return self.rope_theta, self.rope_global_factor

    @classmethod
    def _from_gemma_hf(cls, hf: dict[str, Any], context_window: int | None, *, local_theta: float,
                       global_theta: float, global_factor: float, qk_norm: bool) -> "GemmaConfig":
        for key in ("hidden_activation", "hidden_act"):
            if hf.get(key) not in (None, GELU_TANH):
                raise MobilecError(f"config.json: {key} {hf[key]!r} is not implemented; the Gemma MLP computes "
                                   f"{GELU_TANH}(gate) * up")
        if hf.get("use_bidirectional_attention"):
            raise MobilecError("config.json: use_bidirectional_attention=true (non-causal attention) is not "
                               "implemented; mobilec compiles causal decoders")
        layers = _whole(hf, "num_hidden_layers")
        layer_types, window = read_layer_types(hf, layers, lambda: _pattern_layer_types(hf, layers))
        caps = {key: None if hf.get(key) is None else _positive(hf, key, None)
                for key in ("final_logit_softcapping", "attn_logit_softcapping")}
        # Llama's fields from a view of the config without what is Gemma's (checked here): activation and RoPE
        llama_view = {k: v for k, v in hf.items() if k not in (
            "hidden_activation", "hidden_act", "rope_scaling", "rope_parameters", "rope_theta")}
        base = LlamaConfig.from_hf({**llama_view, "rope_theta": global_theta}, context_window)
        fields = {**dataclasses.asdict(base), "prefill_chunk_size": chunk_within_window(base.prefill_chunk_size, window),
                  "qk_norm": qk_norm}
        return cls(
            **fields,
            query_pre_attn_scalar=_positive(hf, "query_pre_attn_scalar", float(base.head_dim)),
            sliding_window=window,
            layer_types=layer_types,
            rope_local_theta=local_theta,
            rope_global_factor=global_factor,
            **caps,
        )

    def source_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().source_shapes()
        h = self.hidden_size
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            shapes[f"{p}.pre_feedforward_layernorm.weight"] = shapes[f"{p}.post_feedforward_layernorm.weight"] = (h,)
        return shapes

    def param_offsets(self) -> dict[str, float]:
        """Every RMSNorm weight (the layers' four, the q/k norms, the last norm) stored as 1 + w (GemmaRMSNorm)."""
        return {name: 1.0 for name in self.param_sources() if name.endswith("norm.weight")}

    def param_sources(self) -> dict[str, list[str]]:
        src = super().param_sources()
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                src[f"{p}.{norm}.weight"] = [f"{p}.{norm}.weight"]
        return src


class Gemma3TextConfig(GemmaConfig):
    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "Gemma3TextConfig":
        """transformers 5 writes rope_parameters per layer type; older configs rope_theta, rope_local_base_freq
        and rope_scaling (the global layers')."""
        params = hf.get("rope_parameters")
        if isinstance(params, dict) and (SLIDING in params or FULL in params):
            local, full = params.get(SLIDING) or {}, params.get(FULL) or {}
        else:
            local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
            full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1000000.0)}
        if _rope_kind(local) != "default":
            raise MobilecError(f"config.json: RoPE scaling {_rope_kind(local)!r} on the sliding layers is not "
                               "implemented (plain RoPE there)")
        kind = _rope_kind(full)
        if kind not in ("default", "linear"):
            raise MobilecError(f"config.json: RoPE scaling {kind!r} on the global layers is not implemented "
                               "(plain or linear)")
        factor = _positive(full, "factor", None) if kind == "linear" else 1.0
        return cls._from_gemma_hf(
            hf, context_window, local_theta=_positive(local, "rope_theta", 10000.0),
            global_theta=_positive(full, "rope_theta", 1000000.0), global_factor=factor, qk_norm=True)


class Gemma2Config(GemmaConfig):
    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "Gemma2Config":
        """One RoPE for every layer: rope_theta, or transformers 5's rope_parameters."""
        params = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta")}
        if _rope_kind(params) != "default":
            raise MobilecError(f"config.json: RoPE scaling {_rope_kind(params)!r} is not implemented for Gemma 2 "
                               "(plain RoPE)")
        theta = _positive({"rope_theta": params.get("rope_theta") or hf.get("rope_theta") or 10000.0},
                          "rope_theta", None)
        return cls._from_gemma_hf(hf, context_window, local_theta=theta, global_theta=theta, global_factor=1.0,
                                  qk_norm=False)


def _rope_kind(params: dict[str, Any]) -> str:
    if not isinstance(params, dict):
        raise MobilecError(f"config.json: RoPE parameters must be an object, got {params!r}")
    return str(params.get("rope_type", params.get("type")) or "default")


def _pattern_layer_types(hf: dict[str, Any], layers: int) -> list[str]:
    """The attention kind of each layer where the config does not list them: every sliding_window_pattern-th layer
    global (transformers' default 6 for Gemma 3, 2 for Gemma 2)."""
    pattern = hf.get("sliding_window_pattern", 6 if hf.get("model_type") == "gemma3_text" else 2)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise MobilecError(f"config.json: sliding_window_pattern must be a positive whole number, got {pattern!r}")
    return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), computed in float32 and returned in x's dtype. The parameter holds
    1 + w in float32 (GemmaConfig.param_offsets), as the norm uses it: no kernel casts it or adds 1 at run time."""

    def __init__(self, dim: int, eps: float):
        self.weight = nn.Parameter((dim,), "float32")
        self.eps = eps

    def to(self, dtype: str | None = None) -> None:  # pylint: disable=invalid-name,unused-argument
        """The weight stays float32 in a float16 model."""

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x if dtype == "float32" else x.astype("float32")
        out = op.rms_norm(x32, self.weight, axes=[-1], epsilon=self.eps)
        return out if dtype == "float32" else out.astype(dtype)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.gelu(gate, approximate="tanh") * up)


class GemmaAttention(LlamaAttention):
    """Llama's fused q/k/v projection, q/k norms (Gemma 3's own) and cache; this layer's RoPE applied in the graph
    (rotary.py)."""

    def __init__(self, cfg: GemmaConfig, layer_id: int):
        super().__init__(cfg)
        self.sm_scale = 1.0 / math.sqrt(cfg.query_pre_attn_scalar)
        theta, factor = cfg.rope(layer_id)
        self.rotary = RotaryEmbedding.of_base(theta, cfg.head_dim, factor)
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, layer_id: int):
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(cfg, layer_id)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, hidden: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), kv_cache, layer_id)
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaModel(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([GemmaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: Tensor, kv_cache: PagedKVCache) -> Tensor:
        for layer_id, layer in enumerate(self.layers):
            hidden = layer(hidden, kv_cache, layer_id)
        return self.norm(hidden)


class GemmaForCausalLM(LlamaForCausalLM):
    """Llama's exported functions; the embedding scaled, the logits capped, RoPE in the graph."""

    def __init__(self, cfg: GemmaConfig):  # pylint: disable=super-init-not-called
        self.cfg = cfg
        self.model = GemmaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.dtype = "float32"

    def embed(self, input_ids: Tensor) -> Tensor:
        """Scaled by sqrt(hidden_size) in the activations' dtype, as transformers does."""
        return super().embed(input_ids) * math.sqrt(self.cfg.hidden_size)

    def _logits(self, hidden: Tensor) -> Tensor:
        logits = super()._logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else op.tanh(logits / cap) * cap

    def attention_attrs(self) -> dict[str, Any]:
        """The sliding layers' window when it binds, the attention scores' cap when there is one."""
        attrs = sliding_attention_attrs(self.cfg)
        if self.cfg.attn_logit_softcapping is not None:
            attrs[ATTN_LOGIT_CAP_ATTR] = self.cfg.attn_logit_softcapping
        return attrs

    def kv_cache_attention(self) -> dict[str, Any]:
        """No RoPE in the cache (applied here); the sliding layers as sliding_layers.py says."""
        return sliding_kv_cache_attention(self.cfg, RopeMode.NONE)
