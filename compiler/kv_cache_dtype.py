"""The KV cache's storage dtype (`--kv-dtype`): what each name stores, and what `auto` picks for a target.

The paged KV cache of TVM 0.27's runtime (src/runtime/vm/paged_kv_cache.cc) allocates its pages, and its q/k/v
scratch, in one dtype and checks that the q/k/v it is given have that dtype. A float16 cache under float32
activations is therefore built by casting q/k/v to float16 before attention and its output back (models/llama.py);
the CPU attention kernels (kernels/cpu_attention.py) widen float16 to float32 on load and compute in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tvm

from .choices import KV_DTYPES
from .errors import MobilecError

if TYPE_CHECKING:
    from .quantization.schemes import Scheme
    from .targets import TargetSpec

TVM_DTYPES = {"f32": "float32", "f16": "float16"}  # the names implemented so far
AUTO = "f16"  # llama.cpp's default too: half the bytes of float32, +0.00x% perplexity (README)


def check_name(name: str, what: str = "--kv-dtype") -> str:
    if name not in KV_DTYPES:
        raise MobilecError(f"{what} {name!r} is not one of {', '.join(KV_DTYPES)}")
    if name not in TVM_DTYPES and name != "auto":
        raise MobilecError(f"{what} {name}: integer KV caches are not implemented yet (TVM's paged cache stores K/V "
                           f"in the dtype of q/k/v; quantized pages need their own attention kernels); use f16 or f32")
    return name


def resolve(name: str, spec: TargetSpec, scheme: Scheme) -> str:
    """The TVM dtype of the KV cache for `--kv-dtype name`. `auto`: the target file's `device.kv_dtype`, else f16;
    float32 for an unquantized float32 model (q0f32 is the reference build: nothing in it is rounded) and for a
    GPU computing in float32 (no fp16 on the device: PoCL)."""
    check_name(name)
    compute = scheme.float_dtype or spec.device["compute_dtype"]
    gpu = spec.schedule["rules"] == "gpu"
    if name == "auto":
        if scheme.float_dtype == "float32" or (gpu and compute == "float32"):
            return "float32"
        name = spec.device.get("kv_dtype", AUTO)
    dtype = TVM_DTYPES[name]
    if gpu and dtype == "float16" and compute == "float32":
        raise MobilecError(f"--kv-dtype f16 on {spec.name} computing in float32: its attention kernels would compute "
                           f"in float16, which the device lacks (--compute-dtype float32); use --kv-dtype f32")
    return dtype


def value_bytes(dtype: str) -> int:
    """Bytes one stored K or V value takes."""
    return tvm.DataType(dtype).bits // 8


def of_artifact(config: dict) -> str:
    """The KV cache dtype an artifact's config records (artifacts older than the field: the compute dtype)."""
    return config.get("kv_dtype") or config["compute_dtype"]
