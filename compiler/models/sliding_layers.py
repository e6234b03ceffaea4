"""Layers of two attention kinds, sliding-window and global (transformers' layer_types): Gemma 2 and 3, and Qwen2 /
Qwen3 configs with use_sliding_window. Where the window binds (the context window exceeds it) the sliding layers are
TVM's "mha_sliding" kind: mobilec's CPU kernels read the window's pages only, the GPU ones every page
(sliding_pages_all; kernels/gpu_attention.py says why) and mask by position; the module attr LAYER_SLIDING_WINDOW_ATTR
carries the window to passes/replace_cpu_attention.py and replace_gpu_attention.py. TVM's cache computes the new
tokens among themselves with one ragged kernel for all layers, without the window: prompts go in chunks of at most
the window (chunk_within_window), which keeps every such pair inside it. Where every layer slides (a Qwen config with
max_window_layers 0, a Gemma 3 one with fewer layers than its sliding pattern), TVM 0.27's runtime fails with every
layer "mha_sliding" (a null tensor view in Tensor::CreateView): the cache is told full attention and the window is the
plain kernels' (SLIDING_WINDOW_ATTR, as Mistral's)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from tvm.relax.frontend.nn.llm.kv_cache import RopeMode

from ..errors import MobilecError
from ..kernels.cpu_attention import LAYER_SLIDING_WINDOW_ATTR, SLIDING_WINDOW_ATTR
from .llama import _whole

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


@dataclasses.dataclass
class SlidingLayers:
    """Config fields, mixed in after LlamaConfig's."""

    sliding_window: int = 0  # tokens the SLIDING layers see (the last ones, the query's own included); 0: none
    layer_types: tuple[str, ...] = ()  # SLIDING or FULL per layer
    # The cache's sliding layers get every page and the kernels mask by position (GPU targets: the importer sets
    # it), instead of the window's pages only (CPU targets)
    sliding_pages_all: bool = False

    def window_binds(self) -> bool:
        return SLIDING in self.layer_types and self.context_window_size > self.sliding_window

    def every_layer_slides(self) -> bool:
        return bool(self.layer_types) and FULL not in self.layer_types

    def first_layers(self, count: int):
        """As LlamaConfig's, with at least one layer of each attention kind kept: a cut of sliding layers alone
        would build another cache (every_layer_slides)."""
        count = max([count, *(self.layer_types.index(kind) + 1 for kind in set(self.layer_types))])
        cut = super().first_layers(count)  # pylint: disable=no-member
        return dataclasses.replace(cut, layer_types=self.layer_types[:cut.num_hidden_layers])


def read_layer_types(hf: dict[str, Any], layers: int, derive: Callable[[], list[str]]) -> tuple[tuple[str, ...], int]:
    """(the attention kind of each layer, the sliding layers' window: 0 without any): the config's layer_types
    (transformers 5 writes them), else `derive()` from the family's older fields; checked."""
    types = hf.get("layer_types")
    if types is None:
        types = derive()
    if not isinstance(types, list) or len(types) != layers or any(t not in (SLIDING, FULL) for t in types):
        raise MobilecError(f"config.json: layer_types must list {SLIDING!r} or {FULL!r} for each of the "
                           f"{layers} layers, got {types!r}")
    return tuple(types), (_whole(hf, "sliding_window") if SLIDING in types else 0)


def chunk_within_window(prefill_chunk_size: int, window: int) -> int:
    """The prefill chunk: at most the sliding layers' window (0: none)."""
    return min(prefill_chunk_size, window or math.inf)


def sliding_attention_attrs(cfg: SlidingLayers) -> dict[str, Any]:
    """The sliding layers' window for mobilec's attention kernels, when it binds: every layer's where every layer
    slides, else the "mha_sliding" layers'."""
    if not cfg.window_binds():
        return {}
    return {SLIDING_WINDOW_ATTR if cfg.every_layer_slides() else LAYER_SLIDING_WINDOW_ATTR: cfg.sliding_window}


def sliding_kv_cache_attention(cfg: SlidingLayers, rope_mode: RopeMode) -> dict[str, Any]:
    """The cache's attention kinds: the sliding layers "mha_sliding" when the window binds (their window, or every
    page with sliding_pages_all; TVM's runtime keeps every page), else full attention everywhere, the same thing
    there, and where every layer slides (the window is then the kernels', sliding_attention_attrs)."""
    if not cfg.window_binds() or cfg.every_layer_slides():
        return {"attn_kind": "mha", "rope_mode": rope_mode}
    return {"attn_kind": ["mha_sliding" if kind == SLIDING else "mha" for kind in cfg.layer_types],
            "rope_mode": rope_mode,
            "layer_sliding_window_size": cfg.context_window_size if cfg.sliding_pages_all else cfg.sliding_window}
