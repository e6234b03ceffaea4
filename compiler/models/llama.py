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
from ..kernels.integer_dot_gemv import BATCH
from ..model_import.kv_cache_dtype import Carrier, carrier_for
from . import kv_cache_kernels
from .rotary import RotaryEmbedding


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
    qk_norm: bool = False  # an RMSNorm over head_dim on each q and k head before RoPE (Qwen3)
    rope_scaling: dict[str, Any] | None = None  # rope_scaling_of: {"rope_type": "llama3" | "linear", ...}; None: plain
    context_window_size: int = 2048
    prefill_chunk_size: int = 2048
    kv_dtype: str | None = None  # the KV cache's storage (kv_cache_dtype.py); None: the activations' dtype

    @property
    def kv_carrier(self) -> Carrier | None:
        """The float32 geometry a quantized (int8, int4) cache is declared with (kv_cache_dtype.Carrier); None for
        a float cache."""
        carrier = carrier_for(self.kv_dtype, self.num_attention_heads, self.num_key_value_heads, self.head_dim)
        if carrier is not None and self.head_dim % carrier.format.codes_per_cell:
            per_cell = carrier.format.codes_per_cell
            raise MobilecError(f"--kv-dtype {self.kv_dtype}: head_dim {self.head_dim} is not a multiple of {per_cell} "
                               f"(a float32 cell of the carrier holds {per_cell} codes); use f16")
        return carrier

    @property
    def rope_scale(self) -> float:
        """TVM's rope_scale, by which positions are multiplied: 1 / factor for linear scaling, else 1."""
        scaling = self.rope_scaling or {}
        return 1.0 / scaling["factor"] if scaling.get("rope_type") == "linear" else 1

    @property
    def tvm_rope_scaling(self) -> dict[str, Any]:
        """TVM's rope_scaling dict (position_embedding.switch_rope_freq_func), which every kernel applying RoPE
        takes: llama3's fields; {} for plain RoPE and linear scaling (rope_scale)."""
        scaling = self.rope_scaling or {}
        return dict(scaling) if scaling.get("rope_type") == "llama3" else {}

    @classmethod
    def from_hf(cls, hf: dict[str, Any], context_window: int | None = None) -> "LlamaConfig":
        """The config's values, checked: a missing or malformed field, or a feature that changes the model's math
        and is not implemented here (refuse_unsupported), is one line naming the field."""
        refuse_unsupported(hf)
        heads = _whole(hf, "num_attention_heads")
        hidden = _whole(hf, "hidden_size")
        kv_heads = _whole(hf, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise MobilecError(f"config.json: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                               f"({kv_heads}); grouped-query attention needs it to be")
        head_dim = _whole(hf, "head_dim", hidden // heads if hidden >= heads else None)
        if head_dim % 2:
            raise MobilecError(f"config.json: head_dim {head_dim} is odd; rotary embeddings rotate pairs of values")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it under rope_parameters
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        max_pos = _whole(hf, "max_position_embeddings", 2048)
        # A phone rarely affords the full trained window's KV cache; 2048 unless asked.
        window = context_window or min(max_pos, 2048)
        return cls(
            vocab_size=_whole(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_whole(hf, "intermediate_size"),
            num_hidden_layers=_whole(hf, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive(hf, "rms_norm_eps", 1e-6),
            rope_theta=_positive({"rope_theta": rope_theta}, "rope_theta", None),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
            attention_bias=bool(hf.get("attention_bias", False)),
            attention_out_bias=bool(hf.get("attention_out_bias", hf.get("attention_bias", False))),
            rope_scaling=rope_scaling_of(hf),
            context_window_size=window,
            prefill_chunk_size=min(window, 2048),
        )

    def rotary_in_model(self) -> RotaryEmbedding | None:
        """A RoPE the model applies itself (models/rotary.py, the cache then RopeMode.NONE); None: the paged KV
        cache's RoPE over whole heads."""
        return None

    def first_layers(self, count: int) -> "LlamaConfig":
        """This config cut to its first `count` layers (at most all of them): estimate plans activations on it."""
        return dataclasses.replace(self, num_hidden_layers=min(count, self.num_hidden_layers))

    def source_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every checkpoint tensor param_sources reads, as this config implies it (HF layout)."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        h, inter = self.hidden_size, self.intermediate_size
        rows = {"q_proj": q, "k_proj": kv, "v_proj": kv}
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h),
                                              "model.norm.weight": (h,), "lm_head.weight": (self.vocab_size, h)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            for proj, n in rows.items():
                shapes[f"{p}.self_attn.{proj}.weight"] = (n, h)
                shapes[f"{p}.self_attn.{proj}.bias"] = (n,)
            shapes[f"{p}.self_attn.o_proj.weight"] = (h, q)
            shapes[f"{p}.self_attn.o_proj.bias"] = (h,)
            shapes[f"{p}.mlp.gate_proj.weight"] = shapes[f"{p}.mlp.up_proj.weight"] = (inter, h)
            shapes[f"{p}.mlp.down_proj.weight"] = (h, inter)
            shapes[f"{p}.input_layernorm.weight"] = shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
            shapes[f"{p}.self_attn.q_norm.weight"] = shapes[f"{p}.self_attn.k_norm.weight"] = (self.head_dim,)
        used = {name for names in self.param_sources().values() for name in names}
        return {name: shape for name, shape in shapes.items() if name in used}

    def param_offsets(self) -> dict[str, float]:
        """Our parameter name -> a constant added to it when it is stored (compile_model.py): a weight the model only
        ever uses offset (Gemma's RMSNorms scale by 1 + w) is stored offset, so no kernel adds it at every step."""
        return {}

    def param_sources(self) -> dict[str, list[str]]:
        """Our parameter name -> the checkpoint tensors concatenated (along rows) to make it."""
        src: dict[str, list[str]] = {"model.embed_tokens.weight": ["model.embed_tokens.weight"]}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            attn = f"{p}.self_attn"
            src[f"{attn}.qkv_proj.weight"] = [f"{attn}.{x}_proj.weight" for x in "qkv"]
            if self.attention_bias:
                src[f"{attn}.qkv_proj.bias"] = [f"{attn}.{x}_proj.bias" for x in "qkv"]
            if self.qk_norm:
                src[f"{attn}.q_norm.weight"] = [f"{attn}.q_norm.weight"]
                src[f"{attn}.k_norm.weight"] = [f"{attn}.k_norm.weight"]
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


# Far beyond any real model (Llama 3.1 405B: 126 layers, 128 heads, hidden 16384, vocabulary 128256): a config
# past these is malformed, and building it would take forever or exhaust memory rather than fail.
MAX_COUNT = 4096  # layers, heads
MAX_SIZE = 1 << 24  # hidden, intermediate, vocabulary, head sizes
_COUNTS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def _whole(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive whole number from the config (`default` when absent; absent without a default is an error),
    within MAX_COUNT or MAX_SIZE (max_position_embeddings is not bounded: the context window is)."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise MobilecError(f"config.json lacks the field {key!r}; is this a complete Hugging Face config?")
        value = default
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or value != int(value) or value < 1):
        raise MobilecError(f"config.json: {key} must be a positive whole number, got {value!r}")
    most = MAX_COUNT if key in _COUNTS else None if key == "max_position_embeddings" else MAX_SIZE
    if most is not None and value > most:
        raise MobilecError(f"config.json: {key} {value!r} is beyond any model (at most {most}); the config is "
                           f"malformed")
    return int(value)


def _positive(hf: dict[str, Any], key: str, default: float | None) -> float:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise MobilecError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


def _rope_type(hf: dict[str, Any]) -> tuple[str, Any] | None:
    """(field, type) of a RoPE scaling the config asks for, None for plain RoPE. transformers 4 writes it as
    rope_scaling, transformers 5 as rope_parameters (with rope_theta in it); GGUF files carry it as rope_scaling."""
    for key in ("rope_scaling", "rope_parameters"):
        scaling = hf.get(key)
        if scaling is None:
            continue
        if not isinstance(scaling, dict):
            return key, scaling
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in (None, "default"):
            return key, kind
    return None


# RoPE scalings implemented -> the fields each reads (transformers' names). llama3 (every Llama 3.1/3.2
# checkpoint): TVM's rope_freq_llama3, in every kernel that applies RoPE; linear: positions / factor (rope_scale).
ROPE_SCALINGS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
}


def rope_scaling_of(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The config's RoPE scaling as {"rope_type": kind, its fields}, None for plain RoPE. A kind not implemented
    (yarn, longrope, dynamic, ...), or a field missing or malformed, is one line naming the field: compiled with
    plain RoPE, the model would run and silently diverge from the checkpoint."""
    found = _rope_type(hf)
    if found is None:
        return None
    key, kind = found
    if not isinstance(hf[key], dict) or kind not in ROPE_SCALINGS:
        raise MobilecError(f"config.json: {key} asks for RoPE scaling {kind!r}, which mobilec does not implement "
                           f"(plain RoPE, {', '.join(ROPE_SCALINGS)}); compiled, the model would diverge from the "
                           "checkpoint")
    scaling: dict[str, Any] = {"rope_type": kind}
    for name in ROPE_SCALINGS[kind]:
        field = f"{key}.{name}"
        scaling[name] = _positive({field: hf[key].get(name)}, field, None)
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise MobilecError(f"config.json: {key}.high_freq_factor ({scaling['high_freq_factor']}) must exceed "
                           f"low_freq_factor ({scaling['low_freq_factor']}); Llama 3 RoPE interpolates between them")
    return scaling


# Activations the MLP implements (silu(gate) * up); transformers calls silu "swish" too.
SUPPORTED_ACTIVATIONS = ("silu", "swish")


def refuse_unsupported(hf: dict[str, Any]) -> None:
    """Refuse, naming the field, a config asking for something that changes the model's math and that this
    compiler does not implement: compiled anyway, the model would run and silently disagree with the checkpoint."""
    rope_scaling_of(hf)
    factor = hf.get("partial_rotary_factor")
    if factor is not None and factor != 1:
        raise MobilecError(f"config.json: partial_rotary_factor {factor!r} (RoPE on part of each head) is not "
                           "implemented; mobilec rotates the whole head")
    for key in ("hidden_act", "hidden_activation"):
        if hf.get(key) is not None and hf[key] not in SUPPORTED_ACTIVATIONS:
            raise MobilecError(f"config.json: {key} {hf[key]!r} is not implemented; the MLP computes "
                               f"silu(gate) * up ({', '.join(SUPPORTED_ACTIVATIONS)})")
    if hf.get("mlp_bias"):
        raise MobilecError("config.json: mlp_bias=true (biases on the MLP projections) is not implemented yet")
    if hf.get("num_local_experts") or hf.get("num_experts"):
        raise MobilecError("config.json: num_local_experts (a mixture of experts) is not implemented; mobilec "
                           "compiles dense models")
    quantized = hf.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else quantized
        raise MobilecError(f"config.json: quantization_config ({method!r}) marks a pre-quantized checkpoint, whose "
                           "packed weights mobilec cannot read; use the float checkpoint and --quant")


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
        self.kv_dtype = cfg.kv_dtype
        self.carrier = cfg.kv_carrier
        self.qk_norm = cfg.qk_norm
        self.qk_norm_eps = cfg.rms_norm_eps
        self.rotary = cfg.rotary_in_model()
        qkv_rows = (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_rows, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = nn.RMSNorm(cfg.head_dim, -1, cfg.rms_norm_eps, bias=False)
            self.k_norm = nn.RMSNorm(cfg.head_dim, -1, cfg.rms_norm_eps, bias=False)
        self.o_proj = nn.Linear(self.num_q_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_out_bias)
        self.sm_scale = 1.0 / math.sqrt(self.head_dim)  # the softmax's scale of q . k

    def _qkv(self, x: Tensor) -> Tensor:
        """The fused projection as (b, s, heads + 2 kv_heads, head_dim); with qk_norm, each q and k head
        RMS-normalized (RoPE comes after, inside the KV cache's kernels: RopeMode.NORMAL)."""
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, self.num_q_heads + 2 * self.num_kv_heads, self.head_dim))
        if not self.qk_norm:
            return qkv
        q_heads, normed_heads, eps = self.num_q_heads, self.num_q_heads + self.num_kv_heads, self.qk_norm_eps

        def qk_norm(x: te.Tensor, q_weight: te.Tensor, k_weight: te.Tensor) -> te.Tensor:
            """One kernel (a GPU launch, not split / two norms / concat): the q and k heads RMS-normalized over
            head_dim in float32, each by its weight, the v heads as they are."""
            d = x.shape[-1]
            k = te.reduce_axis((0, d), name="k")
            sum_sq = te.compute(x.shape[:-1], lambda *i: te.sum(
                x(*i, k).astype("float32") * x(*i, k).astype("float32"), axis=k), name="qk_sum_sq")

            def value(*i):
                weight = tirx.if_then_else(i[2] < q_heads, q_weight[i[3]], k_weight[i[3]]).astype("float32")
                rsqrt = tirx.rsqrt(sum_sq(*i[:-1]) / tirx.const(int(d), "float32") + tirx.const(eps, "float32"))
                normed = (rsqrt * x(*i).astype("float32") * weight).astype(x.dtype)
                return tirx.if_then_else(i[2] < normed_heads, normed, x(*i))

            return te.compute(x.shape, value, name="qk_norm")

        return op.tensor_expr_op(qk_norm, "qk_norm", [qkv, self.q_norm.weight, self.k_norm.weight])

    def forward(self, x: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        qkv = self._qkv(x)
        if self.rotary is not None:
            qkv = self.rotary.apply(qkv, kv_cache, self.num_q_heads + self.num_kv_heads)
        return self.o_proj(self.attend(qkv, kv_cache, layer_id))

    def attend(self, qkv: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        """Attention of the fused [b, s, heads + 2 kv_heads, head_dim] q/k/v through the paged KV cache; the
        output [b, s, heads * head_dim] in qkv's dtype."""
        b, s, _, _ = qkv.shape
        if self.carrier is not None:
            return self._carrier_attention(qkv, kv_cache, layer_id)
        dtype = qkv.dtype
        # TVM's paged cache takes q/k/v in the dtype it stores (kv_cache_dtype.py)
        if self.kv_dtype not in (None, dtype):
            qkv = qkv.astype(self.kv_dtype)
        out = kv_cache.attention_with_fused_qkv(layer_id, qkv, self.num_q_heads, sm_scale=self.sm_scale)
        if out.dtype != dtype:
            out = out.astype(dtype)
        return op.reshape(out, (b, s, self.num_q_heads * self.head_dim))

    def _carrier_attention(self, qkv: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        """Attention over a quantized cache declared as its float32 carrier (kv_cache_dtype.Carrier): the float32
        q/k/v reshaped to the carrier's rows (no copy), and the real output taken back from the start of the
        declared output rows. Our split kernel quantizes K/V into the carrier's cells. Float16 activations (a
        phone GPU's) are widened to float32 for the carrier and the output narrowed back: the kernels then
        compute scores and sums in float32, where float16 would overflow."""
        b, s, _, _ = qkv.shape
        c = self.carrier
        dtype = qkv.dtype
        if dtype != "float32":
            qkv = qkv.astype("float32")
        out = kv_cache.attention_with_fused_qkv(
            layer_id, op.reshape(qkv, (b, s, c.fused_rows, c.cell)), c.declared_heads, sm_scale=self.sm_scale)
        if c.declared_heads > c.q_rows:
            out = op.split(out, [c.q_rows], axis=2)[0]
        out = op.reshape(out, (b, s, self.num_q_heads * self.head_dim))
        return out.astype(dtype) if dtype != "float32" else out


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
    """The exported functions: embed, prefill, prefill_logits, prefill_hidden_states, decode, batch_decode (where asked
    for), create_tir_paged_kv_cache."""

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

    def batch_decode(self, input_embed: Tensor, kv_cache: PagedKVCache):
        """One token of each of `batch_size` sequences (the cache's current batch, in order) -> each one's logits."""
        return self._logits(self.model(input_embed, kv_cache)), kv_cache

    def attention_attrs(self) -> dict[str, Any]:
        """Module attrs for what this model's attention needs of mobilec's attention kernels beyond TVM's
        (passes/replace_cpu_attention.py, replace_gpu_attention.py); a model with any compiles for LLVM CPU and GPU
        targets only. None here."""
        return {}

    def kv_cache_attention(self) -> dict[str, Any]:
        """The paged KV cache's attention kind per layer and RoPE mode: full attention everywhere, RoPE applied
        to k before it is stored, by the cache (RopeMode.NORMAL, with cfg.rope_theta) or by the model
        (rotary_in_model: RopeMode.NONE)."""
        rope_mode = RopeMode.NORMAL if self.cfg.rotary_in_model() is None else RopeMode.NONE
        return {"attn_kind": "mha", "rope_mode": rope_mode}

    def create_tir_paged_kv_cache(
        self,
        max_batch_size: tirx.Var,
        max_total_seq_len: tirx.Var,
        prefill_chunk_size: tirx.Var,
        page_size: tirx.Var,
        support_sliding_window: tirx.Var,
    ) -> PagedKVCache:
        cfg = self.cfg
        carrier = cfg.kv_carrier
        heads, kv_heads, head_dim, dtype = (
            (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.kv_dtype or self.dtype)
            if carrier is None else
            (carrier.declared_heads, carrier.declared_kv_heads, carrier.cell, "float32"))
        with kv_cache_kernels.parsed_once():
            return TIRPagedKVCache(
                **self.kv_cache_attention(),
                max_batch_size=max_batch_size,
                max_total_seq_len=max_total_seq_len,
                prefill_chunk_size=prefill_chunk_size,
                page_size=page_size,
                support_sliding_window=support_sliding_window,
                layer_partition=relax.ShapeExpr([0, cfg.num_hidden_layers]),
                num_hidden_layers=cfg.num_hidden_layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                qk_head_dim=head_dim,
                v_head_dim=head_dim,
                mla_original_qk_head_dim=0,
                mla_original_v_head_dim=0,
                rope_scale=cfg.rope_scale,
                rope_theta=cfg.rope_theta,
                rope_scaling=cfg.tvm_rope_scaling,
                rope_ext_factors=relax.prim_value(0),
                rotary_dim=head_dim,
                enable_disaggregation=False,
                dtype=dtype,
                target=Target.current(),
            )

    def get_default_spec(self, batch_decode: bool = False) -> nn.spec.ModuleSpec:
        """`batch_decode`: export it too (its symbolic row count is what IntegerDotGEMV batches: BATCH)."""
        hidden = self.cfg.hidden_size
        kv = nn.spec.Object(object_type=PagedKVCache)
        packed = {"param_mode": "packed", "effect_mode": "none"}
        batched = ({"batch_decode": {"input_embed": nn.spec.Tensor([1, BATCH, hidden], self.dtype), "kv_cache": kv,
                                     "$": packed}} if batch_decode else {})
        return nn.spec.ModuleSpec.from_raw(
            {
                "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": packed},
                "prefill": {"input_embed": nn.spec.Tensor([1, "seq_len", hidden], self.dtype), "kv_cache": kv, "$": packed},
                "prefill_logits": {"input_embed": nn.spec.Tensor([1, "seq_len", hidden], self.dtype), "kv_cache": kv, "$": packed},
                "prefill_hidden_states": {"input_embed": nn.spec.Tensor([1, "seq_len", hidden], self.dtype), "kv_cache": kv, "$": packed},
                "decode": {"input_embed": nn.spec.Tensor([1, 1, hidden], self.dtype), "kv_cache": kv, "$": packed},
                **batched,
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
