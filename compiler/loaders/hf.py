"""Hugging Face model directories: config.json plus safetensors or PyTorch .bin weights, single or sharded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import MobilecError
from .checkpoint import Checkpoint, Rows, one_line
from .safetensors_file import SafetensorsFile, SafetensorsFormatError
from .tokenizer import save_auto_tokenizer

# Checked in this order: an index wins over a single file, safetensors over pickled .bin.
_WEIGHT_LAYOUTS = (
    ("model.safetensors.index.json", "safetensors"),
    ("model.safetensors", "safetensors"),
    ("pytorch_model.bin.index.json", "bin"),
    ("pytorch_model.bin", "bin"),
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MobilecError(f"{what} {str(path)!r} is not valid JSON ({one_line(e)}); re-download or fix it") from e


def _weight_files(model_dir: Path) -> tuple[list[Path], str, str]:
    """(files, format, label for the description) of the directory's weights."""
    for name, fmt in _WEIGHT_LAYOUTS:
        index_or_file = model_dir / name
        if not index_or_file.is_file():
            continue
        if not name.endswith(".index.json"):
            return [index_or_file], fmt, name
        weight_map = _read_json(index_or_file, "weight index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise MobilecError(f"weight index {str(index_or_file)!r} has no weight_map; re-download it")
        shards = [model_dir / s for s in dict.fromkeys(weight_map.values())]
        for shard in shards:
            if not shard.is_file():
                raise MobilecError(f"shard {str(shard)!r} listed in {name} is missing; re-download the checkpoint")
        return shards, fmt, f"{len(shards)} {fmt} shards"
    expected = ", ".join(n for n, _ in _WEIGHT_LAYOUTS)
    raise MobilecError(f"no weight files in {str(model_dir)!r} (expected one of {expected}); download the weights")


class _SafetensorsShard:
    def __init__(self, path: Path):
        try:
            # the header's offsets are checked against the file size, so a truncated file fails here
            self._file = SafetensorsFile(path)
        except (OSError, SafetensorsFormatError) as e:
            raise MobilecError(
                f"safetensors file {str(path)!r} is truncated or corrupt ({one_line(e)}); re-download it"
            ) from e
        self.names = self._file.names

    def float32(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        return self._file.float32(name, rows)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file.shape(name)


class _TorchShard:
    def __init__(self, path: Path):
        try:
            # mmap: tensors stay on disk until read; weights_only: never run pickled code from a download.
            state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:
            raise MobilecError(
                f"PyTorch weight file {str(path)!r} is truncated, corrupt or in the pre-1.6 format "
                f"({one_line(e)}); re-download it or convert it to safetensors"
            ) from e
        if not isinstance(state, dict):
            raise MobilecError(f"{str(path)!r} does not hold a state dict; re-save it with model.save_pretrained")
        self._state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        self.names = list(self._state)

    def float32(self, name: str) -> np.ndarray:
        # One copy into a fresh float32 buffer: converts bf16/fp16 and detaches the result from the mapping.
        src = self._state[name]
        out = torch.empty(src.shape, dtype=torch.float32)
        out.copy_(src)
        return out.numpy()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._state[name].shape)


def read_config(model_dir: Path) -> dict[str, Any]:
    """The directory's config.json, checked to name a model_type."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        ggufs = sorted(model_dir.glob("*.gguf"))
        fix = f"pass the file {str(ggufs[0])!r}" if ggufs else "pass a Hugging Face model directory"
        raise MobilecError(f"no config.json in {str(model_dir)!r}; {fix}")
    config = _read_json(config_path, "config")
    if not isinstance(config, dict) or "model_type" not in config:
        raise MobilecError(f"config {str(config_path)!r} has no model_type; re-download config.json")
    return config


def has_weights(model_dir: Path) -> bool:
    return any((model_dir / name).is_file() for name, _ in _WEIGHT_LAYOUTS)


class HFCheckpoint(Checkpoint):
    def __init__(self, model_dir: Path):
        self._dir = model_dir
        config = read_config(model_dir)
        files, fmt, label = _weight_files(model_dir)
        shard_type = _SafetensorsShard if fmt == "safetensors" else _TorchShard
        # Every shard is opened now, so a truncated one fails the compile before any work is done.
        self._where: dict[str, _SafetensorsShard | _TorchShard] = {}
        for f in files:
            shard = shard_type(f)
            self._where.update(dict.fromkeys(shard.names, shard))
        self.hf_config = _normalize_config(config, self._where)
        self.description = f"HF {model_dir.name} ({label})"

    def tensor_names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        shard = self._where.get(name)
        if shard is None:
            raise self._missing(name)
        return shard.shape(name)

    def get(self, name: str) -> np.ndarray:
        shard = self._where.get(name)
        if shard is None:
            raise self._missing(name)
        return shard.float32(name)

    def rows(self, name: str) -> np.ndarray | Rows:
        shard = self._where.get(name)
        if not isinstance(shard, _SafetensorsShard):
            return self.get(name)
        return Rows(shard.shape(name), lambda rows: shard.float32(name, rows))

    def save_tokenizer(self, out_dir: str | os.PathLike) -> None:
        if not any((self._dir / f).is_file() for f in _TOKENIZER_FILES):
            raise MobilecError(
                f"no tokenizer files in {str(self._dir)!r} (expected one of {', '.join(_TOKENIZER_FILES)}); "
                "download them with the model"
            )
        save_auto_tokenizer(self._dir, out_dir, self.description)

    def close(self) -> None:
        self._where = {}


def _normalize_config(config: dict[str, Any], tensors: dict[str, object]) -> dict[str, Any]:
    """Fill in the keys consumers rely on that some config.json files leave implicit."""
    cfg = dict(config)
    # transformers 5 writes rope_theta inside rope_parameters; older files have it at the top level.
    rope_parameters = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and isinstance(rope_parameters, dict) and "rope_theta" in rope_parameters:
        cfg["rope_theta"] = rope_parameters["rope_theta"]
    # Default tying differs between model classes and transformers versions; the weights themselves tell.
    cfg.setdefault("tie_word_embeddings", "lm_head.weight" not in tensors)
    # Qwen2 has q/k/v biases without saying so in its config.
    cfg.setdefault("attention_bias", "model.layers.0.self_attn.q_proj.bias" in tensors)
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if "head_dim" not in cfg and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads)):
        cfg["head_dim"] = hidden // heads  # transformers' default (other values: the model's config check says)
    return cfg
