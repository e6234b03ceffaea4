"""The import stage every command shares: a build plan (target file, quantization scheme: build_plan.py) and a
checkpoint -> the model as a Relax IRModule with its parameters (compile, estimate, inspect and tune start here;
none imports another command)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import tvm

from .. import validate
from ..errors import MobilecError
from ..kernels.cpu_attention import ATTN_LOGIT_CAP_ATTR, LAYER_SLIDING_WINDOW_ATTR, SLIDING_WINDOW_ATTR
from ..loaders import Checkpoint, is_gguf_file, open_checkpoint
from ..loaders.default_model import default_model_path
from ..loaders.gguf_file import GGUFFile, GGUFFormatError
from ..models.llama import LlamaConfig
from ..models.registry import ModelFamily, family_for
from ..quantization import awq, gguf_blocks
from ..quantization.quantize_model import WeightPlan, quantize_model
from ..target.build_plan import BuildPlan
from . import kv_cache_dtype

PAGE_SIZE = 16  # tokens per page of the paged KV cache


def resolve_model_path(model: str | None) -> Path:
    if model in (None, "default"):
        return default_model_path()
    return Path(model)


def keeps_gguf_blocks(model: str | os.PathLike | dict | None) -> bool:
    """Whether `model` (a path, None / "default", or an HF config dict) names a GGUF file whose every tensor the
    `gguf` scheme keeps (resolve_plan's default scheme depends on it); reads the file's header only."""
    if isinstance(model, dict) or not is_gguf_file(path := resolve_model_path(model)):
        return False
    try:
        return gguf_blocks.keeps_every_type(t.tensor_type.name for t in GGUFFile(path).tensors)
    except GGUFFormatError:
        return False  # opening the checkpoint names what is wrong with it


def open_model(model: str | None, weights_required: bool = True) -> Checkpoint:
    """The checkpoint of `model` (a path, or None / "default" for SmolLM2), to be used as a context manager."""
    return open_checkpoint(resolve_model_path(model), weights_required=weights_required)


def tensor_bytes(param) -> int:
    """Bytes of one nn.Parameter as stored."""
    return math.prod(int(d) for d in param.shape) * tvm.DataType(param.dtype).bits // 8


def param_bytes(params) -> int:
    """Bytes of (name, nn.Parameter) pairs as stored: the weights a decode step reads once each."""
    return sum(tensor_bytes(p) for _, p in params)


@dataclasses.dataclass
class ImportedModel:
    family: ModelFamily
    cfg: LlamaConfig
    mod: tvm.IRModule | None  # None when imported with export=False
    params: list  # (name, nn.Parameter) in the order the compiled functions take them
    sources: dict[str, list[str]]  # float parameter -> checkpoint tensors
    plan: WeightPlan  # quantized layer -> how to make its stored arrays
    dtype: str  # activations: the plan's compute dtype
    calibration: awq.Calibration | None = None  # --calibrate: scales folded into the float parameters

    @property
    def param_bytes(self) -> int:
        return param_bytes(self.params)


def import_model(ckpt: Checkpoint, plan: BuildPlan, context_window: int | None,
                 quant_skip: list[str] = (), quantize: bool = True,
                 calibration: awq.Calibration | None = None, export: bool = True,
                 first_layers: int | None = None) -> ImportedModel:
    """Build the nn.Module for the checkpoint's family, quantize its layers by the plan's scheme (unless told not
    to: `inspect` shows the float import first), and export it to a Relax IRModule (unless told not to: the
    parameters' shapes and dtypes, all `estimate` needs of another scheme, come without the seconds exporting
    takes). `first_layers`: only the model's first layers (its config's first_layers), for estimate's activations."""
    validate.context_length(context_window)
    spec = plan.spec
    family = family_for(ckpt.hf_config)
    cfg = dataclasses.replace(family.config_class.from_hf(ckpt.hf_config, context_window), kv_dtype=plan.kv_dtype)
    if first_layers is not None:
        cfg = cfg.first_layers(first_layers)
    if plan.gpu:
        if hasattr(cfg, "sliding_pages_all"):  # kernels/gpu_attention.py says why
            cfg = dataclasses.replace(cfg, sliding_pages_all=True)
        kv_cache_dtype.check_gpu_carrier(cfg.kv_carrier, spec.name)
    check_checkpoint_shapes(ckpt, cfg)
    model = family.model_class(cfg)
    dtype = plan.compute_dtype
    model.to(dtype)
    sources = cfg.param_sources()
    weights = quantize_model(model, plan.scheme, ckpt, sources, list(quant_skip), dtype, calibration,
                             plan.code_order) if quantize else {}
    if not export:  # named_parameters() lists them as export_tvm does
        return ImportedModel(family, cfg, None, list(model.named_parameters()), sources, weights, dtype, calibration)
    kernel_attrs = model.attention_attrs()
    if kernel_attrs and plan.attention_lanes is None and not plan.gpu:
        window = kernel_attrs.get(LAYER_SLIDING_WINDOW_ATTR) or kernel_attrs.get(SLIDING_WINDOW_ATTR)
        needs = ("a sliding window binding within the context" if window else "") + (
            " and " if window and ATTN_LOGIT_CAP_ATTR in kernel_attrs else "") + (
            "capped attention scores (attn_logit_softcapping)" if ATTN_LOGIT_CAP_ATTR in kernel_attrs else "")
        raise MobilecError(f"this {family.name} model's attention ({needs}) is implemented by mobilec's CPU and GPU "
                           f"attention kernels only, which target {spec.name} does not use"
                           + (f"; --context-window {window} or less needs no window" if window else ""))
    # the serving engine's batched decode, where the decode GEMVs are integer-dot kernels that take several rows
    batch_decode = bool(weights) and plan.integer_decode
    with spec.model_target():
        mod, params = model.export_tvm(spec=model.get_default_spec(batch_decode))
    for key, value in kernel_attrs.items():  # passes/replace_{cpu,gpu}_attention.py read them
        mod = mod.with_attr(key, value)
    # the CPU attention kernels that replace TVM's apply the same RoPE scaling (passes/replace_cpu_attention.py)
    mod = mod.with_attr(kv_cache_dtype.ROPE_ATTR, json.dumps({"rope_scale": cfg.rope_scale,
                                                              "rope_scaling": cfg.tvm_rope_scaling,
                                                              "rope_theta": cfg.rope_theta}))
    if cfg.kv_carrier is not None:  # the kernels that read the packed cells need the real geometry
        mod = mod.with_attr(kv_cache_dtype.KV_FORMAT_ATTR,
                            {**cfg.kv_carrier.module_attr(), "rope_theta": cfg.rope_theta})
    return ImportedModel(family, cfg, mod, params, sources, weights, dtype, calibration)


def check_checkpoint_shapes(ckpt: Checkpoint, cfg: LlamaConfig) -> None:
    """Every tensor the model reads is in the checkpoint with the shape its config implies, checked by the
    checkpoint's own tensor names before any weight is read or anything built (a config-only checkpoint, as
    `estimate` takes, has no tensors to check)."""
    if not ckpt.tensor_names():
        return
    for name, want in cfg.source_shapes().items():
        got = tuple(int(d) for d in ckpt.shape(name))
        if got != want:
            raise MobilecError(f"tensor {name} has shape {got} in {ckpt.description} but its config implies {want}; "
                               f"the checkpoint and its config disagree")
