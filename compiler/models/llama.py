"""Llama-family decoder (SmolLM2, TinyLlama, Llama 2/3) in Relax's nn frontend, with TVM's paged KV cache."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tvm import relax, te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.target import Target

from ..errors import MobilecError


@dataclasses.dataclass
class LlamaConfig:
    """The subset of a Hugging Face config that shapes the compiled model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool = False  # biases on q/k/v
    attention_out_bias: bool = False  # bias on o_proj
    context_window_size: int = 2048
    prefill_chunk_size: int = 2048

    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "LlamaConfig":
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            rope_theta = hf.get("rope_theta")
            if rope_theta is None:  # transformers 5 nests it under rope_parameters
                rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            scaling = hf.get("rope_scaling") or {}
            if hf.get("mlp_bias"):
                raise MobilecError("MLP biases (mlp_bias=true) are not supported yet")
            if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
                raise MobilecError(
                    f"rope scaling {scaling.get('rope_type', scaling.get('type'))!r} is not supported yet; "
                    "use a checkpoint with default RoPE"
                )
            max_pos = int(hf.get("max_position_embeddings", 2048))
            # A phone rarely affords the full trained window's KV cache; 2048 unless asked.
            window = context_window or min(max_pos, 2048)
            return cls(
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_hidden_layers=int(hf["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_position_embeddings=max_pos,
                attention_bias=bool(hf.get("attention_bias", False)),
                attention_out_bias=bool(hf.get("attention_out_bias", hf.get("attention_bias", False))),
                context_window_size=window,
                prefill_chunk_size=min(window, 2048),
            )
        except KeyError as err:
            raise MobilecError(f"config.json lacks the field {err.args[0]!r}; is this a complete Hugging Face config?") from None

    def param_sources(self) -> dict[str, list[str]]:
        """Our parameter name -> the checkpoint tensors concatenated (along rows) to make it."""
        src: dict[str, list[str]] = {"model.embed_tokens.weight": ["model.embed_tokens.weight"]}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            attn = f"{p}.self_attn"
            src[f"{attn}.qkv_proj.weight"] = [f"{attn}.{x}_proj.weight" for x in "qkv"]
            if self.attention_bias:
                src[f"{attn}.qkv_proj.bias"] = [f"{attn}.{x}_proj.bias" for x in "qkv"]
            src[f"{attn}.o_proj.weight"] = [f"{attn}.o_proj.weight"]
            if self.attention_out_bias:
                src[f"{attn}.o_proj.bias"] = [f"{attn}.o_proj.bias"]
            src[f"{p}.mlp.gate_up_proj.weight"] = [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"]
            src[f"{p}.mlp.down_proj.weight"] = [f"{p}.mlp.down_proj.weight"]
            for norm in ("input_layernorm", "post_attention_layernorm"):
                src[f"{p}.{norm}.weight"] = [f"{p}.{norm}.weight"]
        src["model.norm.weight"] = ["model.norm.weight"]
        if not self.tie_word_embeddings:
            src["lm_head.weight"] = ["lm_head.weight"]
        return src


def _take_last_token(x: te.Tensor) -> te.Tensor:
    b, s, h = x.shape
    return te.compute((b, 1, h), lambda i, _, k: x[i, s - 1, k], name="take_last_token")


class Embedding(nn.Embedding):
    """Token embedding that also serves as the output projection when the model ties them."""

    def project(self, hidden: Tensor) -> Tensor:
        return op.matmul(hidden, op.permute_dims(self.weight))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        self.intermediate_size = cfg.intermediate_size
        # gate and up share one weight so decode reads both with one GEMV.
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        gate, up = op.split(gate_up, 2, axis=-1)
        return self.down_proj(op.silu(gate) * up)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        self.num_q_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        qkv_rows = (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_rows, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_q_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_out_bias)

    def forward(self, x: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, self.num_q_heads + 2 * self.num_kv_heads, self.head_dim))
        out = kv_cache.attention_with_fused_qkv(
            layer_id, qkv, self.num_q_heads, sm_scale=1.0 / math.sqrt(self.head_dim)
        )
        return self.o_proj(op.reshape(out, (b, s, self.num_q_heads * self.head_dim)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)
        self.mlp = LlamaMLP(cfg)

    def forward(self, hidden: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), kv_cache, layer_id)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)

    def forward(self, hidden: Tensor, kv_cache: PagedKVCache) -> Tensor:
        for layer_id, layer in enumerate(self.layers):
            hidden = layer(hidden, kv_cache, layer_id)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):  # pylint: disable=too-many-instance-attributes
    """The exported functions: embed, prefill, prefill_logits, prefill_hidden_states, decode, create_tir_paged_kv_cache."""

    def __init__(self, cfg: LlamaConfig):
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.dtype = "float32"

    def to(self, dtype: str | None = None):
        super().to(dtype=dtype)
        if dtype is not None:
            self.dtype = dtype

    def _logits(self, hidden: Tensor) -> Tensor:
        if self.cfg.tie_word_embeddings:
            logits = self.model.embed_tokens.project(hidden)
        else:
            logits = self.lm_head(hidden)
        return logits.astype("float32") if logits.dtype != "float32" else logits

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token ids [seq_len] -> the [1, seq_len, hidden] input of prefill/decode."""
        return op.reshape(self.model.embed_tokens(input_ids), (1, input_ids.shape[0], self.cfg.hidden_size))

    def prefill(self, input_embed: Tensor, kv_cache: PagedKVCache):
        """Run the prompt; return the logits of its last token only (what generation needs)."""
        hidden = self.model(input_embed, kv_cache)
        last = op.tensor_expr_op(_take_last_token, "take_last_token", [hidden])
        return self._logits(last), kv_cache

    def prefill_logits(self, input_embed: Tensor, kv_cache: PagedKVCache):
        """Run the prompt; return the logits of every position (for perplexity and tests)."""
        return self._logits(self.model(input_embed, kv_cache)), kv_cache

    def prefill_hidden_states(self, input_embed: Tensor, kv_cache: PagedKVCache):
        """Run the prompt; return every decoder block's output [num_layers, seq_len, hidden] (per-layer accuracy)."""
        hidden, outputs = input_embed, []
        for layer_id, layer in enumerate(self.model.layers):
            hidden = layer(hidden, kv_cache, layer_id)
            outputs.append(hidden)
        return op.concat(outputs, dim=0), kv_cache

    def decode(self, input_embed: Tensor, kv_cache: PagedKVCache):
        return self._logits(self.model(input_embed, kv_cache)), kv_cache

    def create_tir_paged_kv_cache(
        self,
        max_batch_size: tirx.Var,
        max_total_seq_len: tirx.Var,
        prefill_chunk_size: tirx.Var,
        page_size: tirx.Var,
        support_sliding_window: tirx.Var,
    ) -> PagedKVCache:
        cfg = self.cfg
        return TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=relax.ShapeExpr([0, cfg.num_hidden_layers]),
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            qk_head_dim=cfg.head_dim,
            v_head_dim=cfg.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL,
            rope_scale=1,
            rope_theta=cfg.rope_theta,
            rope_scaling={},
            rope_ext_factors=relax.prim_value(0),
            rotary_dim=cfg.head_dim,
            enable_disaggregation=False,
            dtype=self.dtype,
            target=Target.current(),
        )

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        hidden = self.cfg.hidden_size
        kv = nn.spec.Object(object_type=PagedKVCache)
        packed = {"param_mode": "packed", "effect_mode": "none"}
        return nn.spec.ModuleSpec.from_raw(
            {
                "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": packed},
                "prefill": {"input_embed": nn.spec.Tensor([1, "seq_len", hidden], self.dtype), "kv_cache": kv, "$": packed},
                "prefill_logits": {"input_embed": nn.spec.Tensor([1, "seq_len", hidden], self.dtype), "kv_cache": kv, "$": packed},
                "prefill_hidden_states": {"input_embed": nn.spec.Tensor([1, "seq_len", hidden], self.dtype), "kv_cache": kv, "$": packed},
                "decode": {"input_embed": nn.spec.Tensor([1, 1, hidden], self.dtype), "kv_cache": kv, "$": packed},
                "create_tir_paged_kv_cache": {
                    "max_batch_size": int,
                    "max_total_seq_len": int,
                    "prefill_chunk_size": int,
                    "page_size": int,
                    "support_sliding_window": int,
                    "$": {"param_mode": "none", "effect_mode": "none"},
                },
            },
            self,
        )
