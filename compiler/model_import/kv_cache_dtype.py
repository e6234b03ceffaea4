"""The KV cache's storage dtype (`--kv-dtype`): what each name stores, and what `auto` picks for a target.

The paged KV cache of TVM 0.27's runtime (src/runtime/vm/paged_kv_cache.cc) allocates its pages, and its q/k/v
scratch, in one dtype and checks that the q/k/v it is given have that dtype. A float16 cache under float32
activations is therefore built by casting q/k/v to float16 before attention and its output back (models/llama.py);
the CPU attention kernels (kernels/cpu_attention.py) widen float16 to float32 on load and compute in float32.

A quantized cache (int8, int4; CPU and GPU targets) cannot be declared to that runtime in its own dtype: it is
declared as a float32 cache of another geometry whose cells carry the packed codes and their parameters (Carrier,
in the CodeFormat of its dtype), and every kernel that reads or writes the packed cells is ours
(kernels/cpu_attention.py, kernels/gpu_attention.py, swapped in by passes/replace_cpu_attention.py and
replace_gpu_attention.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import tvm

from ..choices import KV_DTYPE_NAMES, KV_DTYPES
from ..errors import MobilecError

if TYPE_CHECKING:
    from ..quantization.schemes import Scheme
    from ..target.targets import TargetSpec

TVM_DTYPES = dict(zip(KV_DTYPE_NAMES, ("float32", "float16", "int8", "int4"), strict=True))
# llama.cpp's default too: half the bytes of float32, within 0.001% perplexity on SmolLM2 (docs/quantization.md)
AUTO = "f16"


@dataclasses.dataclass(frozen=True)
class CodeFormat:
    """How a quantized cache stores one token's K or V row of one KV head: head_dim codes of `bits` bits (32 // bits
    to a float32 cell of the carrier) and, per group of channels (`groups`: K's, V's; None: the whole row), one
    float32 cell of parameters that dequantize them: x ~ code * scale (+ min)."""

    name: str
    bits: int
    params: int  # per group: the scale (a float32 cell), or the scale and the min (bfloat16 halves of the cell)
    groups: tuple[int | None, int | None] = (None, None)

    @property
    def codes_per_cell(self) -> int:
        return 32 // self.bits


# int8: symmetric per row, scale = max|x| / 127, code = round(x / scale) in [-127, 127].
# int4: asymmetric per group of channels, scale = (max - min) / 15 and the min stored as bfloat16 (scale in the low
# half of the cell, min in the high one), code = round((x - min) / scale) in [0, 15] with the stored scale and min,
# two codes a byte (code 2j in the low nibble of byte j, 2j + 1 in the high one). K in groups of 8 channels, V in
# groups of 16: K's error is what costs perplexity (SmolLM2, LICENSE, transformers with K/V round-tripped: K alone
# at groups of 16 +4.5%, V alone +0.1%), and bfloat16 parameters keep K's 8 groups in the cells float32 ones took
# for 4. SmolLM2 gguf vs the float32 cache: LICENSE +2.8% (groups of 16, float32 parameters: +4.7%), pydoc topics
# +1.0% (docs/quantization.md).
CODE_FORMATS = {"int8": CodeFormat("int8", 8, 1), "int4": CodeFormat("int4", 4, 2, groups=(8, 16))}


def check_name(name: str, what: str = "--kv-dtype") -> str:
    if name not in KV_DTYPES:
        raise MobilecError(f"{what} {name!r} is not one of {', '.join(KV_DTYPES)}")
    return name


def resolve(name: str, spec: TargetSpec, scheme: Scheme) -> str:
    """The TVM dtype of the KV cache for `--kv-dtype name`. `auto`: the target file's `device.kv_dtype`, else f16;
    float32 for an unquantized float32 model (q0f32 is the reference build: nothing in it is rounded) and for a
    GPU computing in float32 (no fp16 on the device: PoCL)."""
    check_name(name)
    if name == "auto":
        if scheme.float_dtype == "float32" or (_gpu(spec) and _compute(spec, scheme) == "float32"):
            return "float32"
        name = spec.device.get("kv_dtype", AUTO)
    if name not in names_for(spec):
        raise MobilecError(f"--kv-dtype {name} on {spec.name}: not implemented there (mobilec's quantized-cache "
                           f"kernels are for LLVM CPU and GPU targets); use f16")
    if _half_on_float32_gpu(name, spec, scheme):
        raise MobilecError(f"--kv-dtype f16 on {spec.name} computing in float32: its attention kernels would compute "
                           f"in float16, which the device lacks (--compute-dtype float32); use --kv-dtype f32")
    return TVM_DTYPES[name]


def _gpu(spec: TargetSpec) -> bool:
    return spec.schedule["rules"] == "gpu"


def _compute(spec: TargetSpec, scheme: Scheme) -> str:
    return scheme.float_dtype or spec.device["compute_dtype"]


def _half_on_float32_gpu(name: str, spec: TargetSpec, scheme: Scheme) -> bool:
    """A float16 cache on a GPU computing in float32: its attention kernels would compute in float16."""
    return _gpu(spec) and TVM_DTYPES[name] == "float16" and _compute(spec, scheme) == "float32"


@dataclasses.dataclass(frozen=True)
class Carrier:
    """The float32 geometry a quantized cache is declared to TVM's runtime with, for a model of `heads` query heads,
    `kv_heads` KV heads of `head_dim`, storing its rows in `format`. A declared head row of `cell` float32 holds one
    real head's codes; the parameters follow, `cell` to a declared row, in the param_rows rows after the kv_heads
    code rows (param_position). The fused qkv projection output, (heads + 2 kv_heads, head_dim) float32 per token,
    is reshaped for free to fused_rows rows of `cell`; q and the attention output keep their real floats at the
    start of their declared rows (row-major (heads, head_dim), the first q_rows rows), which holds them since
    declared_heads * cell >= heads * head_dim."""

    format: CodeFormat
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def cell(self) -> int:
        return self.head_dim // self.format.codes_per_cell

    def group(self, kv: int) -> int:
        """Channels per parameter cell of K (kv 0) or V (kv 1) rows: the format's group, or the largest power of two
        dividing both it and head_dim (head_dim 40, group 16: 8), or the whole row."""
        group = self.format.groups[kv]
        return self.head_dim if group is None else math.gcd(group, self.head_dim)

    def row_params(self, kv: int) -> int:
        """Parameter cells of one K (kv 0) or V (kv 1) head row."""
        return self.head_dim // self.group(kv)

    @property
    def param_rows(self) -> int:
        """Declared rows per token for the parameters, as many in the K plane as in the V one (the larger need)."""
        return -(-self.kv_heads * max(self.row_params(0), self.row_params(1)) // self.cell)

    @property
    def declared_kv_heads(self) -> int:
        return self.kv_heads + self.param_rows

    @property
    def fused_rows(self) -> int:
        return self.format.codes_per_cell * (self.heads + 2 * self.kv_heads)

    @property
    def q_rows(self) -> int:
        """The declared rows that hold the real q (and output) floats."""
        return self.format.codes_per_cell * self.heads

    @property
    def declared_heads(self) -> int:
        return self.fused_rows - 2 * self.declared_kv_heads

    def param_position(self, h, group, kv: int):
        """(declared head, cell) of the parameter cell of channel group `group` of KV head h's K (kv 0) or V (kv 1)
        row (h, group: ints or TIR indices)."""
        index = h * self.row_params(kv) + group
        return self.kv_heads + index // self.cell, index % self.cell

    def module_attr(self) -> dict[str, object]:
        """The real geometry as the importer records it on the IRModule (`KV_FORMAT_ATTR`), for the kernels."""
        return {"format": self.format.name, "heads": self.heads, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim}


# TVM 0.27's GPU prefill kernels, which the paged cache creates (for the carrier's geometry) before ours replace
# them, fail to build for rows of fewer floats ("Prefill tile is incompatible with the scheduler's thread
# factorization")
GPU_MIN_CELL = 8


def check_gpu_carrier(carrier: Carrier | None, target: str) -> None:
    """Refuses, in one line, a quantized cache whose carrier rows TVM's GPU kernels cannot be built for."""
    if carrier is not None and carrier.cell < GPU_MIN_CELL:
        least = GPU_MIN_CELL * carrier.format.codes_per_cell
        raise MobilecError(f"--kv-dtype {carrier.format.name} on {target}: heads of {carrier.head_dim} channels make "
                           f"carrier rows of {carrier.cell} floats, for which TVM 0.27's GPU prefill kernels do not "
                           f"build (heads of {least} channels or more do); use --kv-dtype f16")


def carrier_for(dtype: str | None, heads: int, kv_heads: int, head_dim: int) -> Carrier | None:
    """The carrier of a cache in TVM dtype `dtype`; None for a float cache."""
    code_format = CODE_FORMATS.get(dtype)
    return None if code_format is None else Carrier(code_format, heads, kv_heads, head_dim)


KV_FORMAT_ATTR = "mobilec.kv_format"  # IRModule attr: a quantized cache's real geometry (Carrier.module_attr)
# IRModule attr: the RoPE the cache's kernels apply, as JSON {"rope_scale": TVM's rope_scale, "rope_scaling": TVM's
# rope_scaling dict, "rope_theta"} (models/llama.py; always over the whole head: a partial RoPE is applied in the
# model, RopeMode.NONE), for the kernels passes/replace_cpu_attention.py builds
ROPE_ATTR = "mobilec.rope"


def bytes_per_token_layer(dtype: str, kv_heads: int, head_dim: int) -> int:
    """Bytes the runtime allocates for one token's K and V in one layer (a quantized cache: its float32 carrier,
    codes and the cells that hold their parameters; counted as allocated, since that is what memory holds and
    decode reads)."""
    carrier = carrier_for(dtype, kv_heads, kv_heads, head_dim)  # (the query heads do not enter the pages)
    if carrier is not None:
        return 2 * carrier.declared_kv_heads * carrier.cell * 4
    return 2 * kv_heads * head_dim * tvm.DataType(dtype).bits // 8


def layer_bytes(dtype: str, kv_heads: int, head_dim: int, tokens: int, page_size: int) -> int:
    """One layer's pages for `tokens` tokens as the runtime allocates them: (pages, 2, kv heads, page size, head dim)
    as declared (bytes_per_token_layer), one page more than the tokens need."""
    pages = -(-tokens // page_size) + 1
    return pages * page_size * bytes_per_token_layer(dtype, kv_heads, head_dim)


def scratch_bytes_per_token(dtype: str, heads: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of the cache's attention scratch per token of a prefill chunk, as the runtime allocates them: q, k, v
    and output in the cache's (declared) dtype, and two float32 log-sum-exp arrays."""
    carrier = carrier_for(dtype, heads, kv_heads, head_dim)
    if carrier is not None:
        return (2 * carrier.declared_heads + 2 * carrier.declared_kv_heads) * carrier.cell * 4 \
            + 2 * carrier.declared_heads * 4
    return (2 * heads + 2 * kv_heads) * head_dim * tvm.DataType(dtype).bits // 8 + 2 * heads * 4


def conversion_bytes_per_token(dtype: str, activations: str, heads: int, kv_heads: int, head_dim: int) -> int:
    """Bytes per prefill token of what a cache in `dtype` adds to the activations: the q/k/v and output cast to a
    float dtype other than the activations', or (int8, int4) the real output copied out of the carrier's rows
    (and, under float16 activations, q/k/v widened to the float32 carrier)."""
    if dtype in CODE_FORMATS:
        widened = 0 if activations == "float32" else (heads + 2 * kv_heads) * head_dim * 4
        return widened + heads * head_dim * 4
    if dtype == activations:
        return 0
    return (2 * heads + 2 * kv_heads) * head_dim * tvm.DataType(dtype).bits // 8


def names_for(spec: TargetSpec) -> list[str]:
    """The --kv-dtype names (not auto) `spec` takes: the quantized ones on GPU and LLVM CPU targets."""
    quantized = _gpu(spec) or spec.tvm_target_json["kind"] == "llvm"
    return [name for name, dtype in TVM_DTYPES.items() if dtype not in CODE_FORMATS or quantized]


def names_taken(spec: TargetSpec, scheme: Scheme) -> list[str]:
    """The --kv-dtype names (not auto) `resolve` takes for `spec` and `scheme` (a GPU computing in float32 has no
    float16 cache)."""
    return [name for name in names_for(spec) if not _half_on_float32_gpu(name, spec, scheme)]


def of_artifact(config: dict) -> str:
    """The KV cache dtype an artifact's config records (artifacts older than the field: the compute dtype)."""
    return config.get("kv_dtype") or config["compute_dtype"]
