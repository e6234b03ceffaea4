"""Swap a model's linear and embedding layers for quantized ones, and plan how each stored array is made."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

import numpy as np
from tvm.relax.frontend import nn

from ..errors import MobilecError
from ..loaders import Checkpoint
from ..loaders.checkpoint import Rows
from .awq import Calibration
from .gguf_blocks import convert_joined, layout_for
from .group import GroupLayout, output_layer_layout, quantize
from .hvx_blocks import stored_arrays
from .modules import QuantizedEmbedding, QuantizedLinear
from .schemes import Scheme

# module path -> () -> {param suffix: array}
WeightPlan = dict[str, Callable[[], dict[str, np.ndarray]]]


def _weight_layers(module: nn.Module, prefix: str = ""):
    """(path, parent, attribute, layer) for every nn.Linear / nn.Embedding, in parameter order."""
    for attr, child in vars(module).items():
        path = f"{prefix}{attr}"
        if isinstance(child, nn.Linear | nn.Embedding):
            yield path, module, attr, child
        elif isinstance(child, nn.ModuleList):
            for i, item in enumerate(child):
                yield from _weight_layers(item, f"{path}.{i}.")
        elif isinstance(child, nn.Module):
            yield from _weight_layers(child, f"{path}.")


def _skipped(path: str, patterns: list[str], tied: bool) -> bool:
    names = {path}
    if tied and path == "model.embed_tokens":
        names.add("lm_head")  # with tied embeddings the embedding table is the output layer
    return any(fnmatch.fnmatch(n, p) or fnmatch.fnmatch(n, f"{p}.*") for n in names for p in patterns)


def _is_output_layer(path: str, layer: nn.Module) -> bool:
    return path == "lm_head" or isinstance(layer, nn.Embedding)


def quantize_model(
    model: nn.Module, scheme: Scheme, ckpt: Checkpoint, sources: dict[str, list[str]], skip: list[str], dtype: str,
    calibration: Calibration | None = None, code_order: str = "plain",
) -> WeightPlan:
    """Replace layers in place per `scheme` (except those matching `skip`); return how to make their arrays.
    With a `calibration`, group-quantized layers are scaled and rounded by it (--calibrate awq). `code_order`: the
    order the target's kernels read codes in (group.CODE_ORDERS), for the layouts that can take it."""
    plan: WeightPlan = {}
    if scheme.kind == "float":
        if skip:
            raise MobilecError(f"--quant-skip has no effect with the float scheme {scheme.name}; drop it")
        return plan
    tied = "lm_head.weight" not in sources
    layers = list(_weight_layers(model))
    for pattern in skip:
        if not any(_skipped(path, [pattern], tied) for path, *_ in layers):
            raise MobilecError(
                f"--quant-skip {pattern!r} matches no layer; layers are named like {layers[0][0]}, "
                f"model.layers.0.mlp.down_proj, {layers[-1][0]}"
            )
    for path, parent, attr, layer in layers:
        if _skipped(path, skip, tied):
            continue
        weight_sources = sources[f"{path}.weight"]
        if scheme.kind == "gguf":
            layout = layout_for({src: ckpt.get_gguf_blocks(src)[0] for src in weight_sources}, path)
            if layout is None:
                continue
            layout = layout.with_code_order(code_order, _rows(layer))
            plan[path] = lambda s=weight_sources, lay=layout: convert_joined(
                [ckpt.get_gguf_blocks(x)[:2] for x in s], lay)
        else:
            layout = output_layer_layout(scheme.layout) if _is_output_layer(path, layer) else scheme.layout
            layout = layout.with_code_order(code_order, _rows(layer))
            # the weight is read only where it is rounded here: calibrated layers were rounded as calibration ran
            quantizer = calibration.quantize if calibration else lambda _path, weight, lay: quantize(weight(), lay)
            plan[path] = lambda p=path, s=weight_sources, lay=layout, q=quantizer: q(
                p, lambda: _float_weight(ckpt, s), lay)
        if layout.code_order == "hvx":  # scales and mins re-laid with the codes: the whole weight, once made
            plan[path] = lambda made=plan[path], lay=layout, k=_columns(layer): stored_arrays(made(), lay, k)
        setattr(parent, attr, _replacement(layer, layout, dtype))
    return plan


def _float_weight(ckpt: Checkpoint, sources: list[str]) -> np.ndarray | Rows:
    """A layer's float weight [n, k]: one checkpoint tensor as its Rows (quantized a slice at a time), or several
    (q/k/v, gate/up) joined along n."""
    return ckpt.rows(sources[0]) if len(sources) == 1 else np.concatenate([ckpt.get(x) for x in sources], axis=0)


def _rows(layer: nn.Module) -> int:
    """The rows (N) of the layer's weight: an embedding's entries, a linear layer's outputs."""
    return int(layer.num) if isinstance(layer, nn.Embedding) else int(layer.out_features)


def _columns(layer: nn.Module) -> int:
    """The columns (K) of the layer's weight: an embedding's dimension, a linear layer's inputs."""
    return int(layer.dim) if isinstance(layer, nn.Embedding) else int(layer.in_features)


def _replacement(layer: nn.Module, layout: GroupLayout, dtype: str) -> nn.Module:
    if isinstance(layer, nn.Embedding):
        return QuantizedEmbedding(int(layer.num), int(layer.dim), layout, dtype)
    return QuantizedLinear(int(layer.in_features), int(layer.out_features), layout, layer.bias is not None, dtype)
