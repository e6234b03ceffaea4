"""Decode's floor, computed one way for everything that reports it (estimate, bench, profile, bench/): the bytes
one decode token reads (every weight once; of the token-embedding table one row, or all of it when it is also the
output layer; the KV cache up to the position) over the memory bandwidth, and the share of it a speed reaches."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .artifacts.artifact import Artifact
from .errors import MobilecError
from .model_import import kv_cache_dtype

EMBEDDING = "model.embed_tokens."
LM_HEAD = "lm_head."


@dataclasses.dataclass(frozen=True)
class ReadBytes:
    """What one decode step reads from memory, `context_len` tokens into the sequence."""

    weights: int  # every weight decode reads, the embedding table as embedding_read
    kv_cache: int  # layers x 2 x kv heads x head dim x context_len x kv_dtype bytes
    context_len: int
    tied_embeddings: bool  # the embedding table is also the output layer, so decode reads all of it
    embedding_table: int  # bytes of the whole token-embedding table
    embedding_read: int  # of it, what a decode step reads: all of it when tied, else one row
    kv_bytes_per_token: int  # the KV cache of one token, all layers
    source: str

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total}


def decode_read(tensors: Iterable[tuple[bool, int, int]], tied: bool, kv_bytes_per_token: int, context_len: int,
                source: str) -> ReadBytes:
    """ReadBytes from (is part of the embedding table, bytes, rows) of every stored tensor."""
    tensors = list(tensors)
    table = sum(nbytes for embedding, nbytes, _ in tensors if embedding)
    row = sum(nbytes // rows for embedding, nbytes, rows in tensors if embedding)
    read = table if tied else row
    weights = sum(nbytes for _, nbytes, _ in tensors) - table + read
    return ReadBytes(weights, kv_bytes_per_token * context_len, context_len, tied, table, read, kv_bytes_per_token,
                     source)


def kv_bytes_per_token(layers: int, kv_heads: int, key_dim: int, value_dim: int, dtype_bytes: int) -> int:
    """The KV cache of one token over all layers."""
    return layers * kv_heads * (key_dim + value_dim) * dtype_bytes


def floor_ms(bytes_per_token: int, bandwidth_gbs: float) -> float:
    return bytes_per_token / (bandwidth_gbs * 1e9) * 1e3


def floor_figures(read: ReadBytes, bandwidth_gbs: float, tok_s: float) -> dict[str, float]:
    """The decode floor at this bandwidth and the share of it `tok_s` reaches."""
    floor_tok_s = bandwidth_gbs * 1e9 / read.total
    return {"bytes_per_token": read.total, "floor_tok_s": floor_tok_s, "floor_ms": 1e3 / floor_tok_s,
            "floor_fraction": tok_s / floor_tok_s}


def artifact_tied_embeddings(artifact: Artifact) -> bool:
    """Whether the artifact's output layer is its embedding table: no lm_head.* weights. The model config's
    tie_word_embeddings, when present, must agree."""
    tied = not any(t["name"].startswith(LM_HEAD) for t in artifact.index["tensors"])
    stated = artifact.config["model"]["config"].get("tie_word_embeddings")
    if stated is not None and bool(stated) != tied:
        raise MobilecError(f"{artifact.path}: tie_word_embeddings is {stated} but params/index.json "
                           f"{'has no' if tied else 'has'} lm_head weights; recompile the artifact")
    return tied


def artifact_read_bytes(artifact: Artifact, context_len: int) -> ReadBytes:
    """Bytes one decode step of `artifact` reads at `context_len` tokens of context, from params/index.json
    (every tensor is a weight the decode step reads) and the model config (the KV cache's dtype: kv_dtype, or in
    artifacts older than it, the compute dtype)."""
    cfg = artifact.config
    model = cfg["model"]["config"]
    tied = artifact_tied_embeddings(artifact)
    kv_dtype = kv_cache_dtype.of_artifact(cfg)
    kv_token = model["num_hidden_layers"] * kv_cache_dtype.bytes_per_token_layer(
        kv_dtype, model["num_key_value_heads"], model["head_dim"])
    embedding_note = "tied embedding: read whole" if tied else "untied embedding: one row"
    return decode_read(((t["name"].startswith(EMBEDDING), t["nbytes"], t["shape"][0])
                        for t in artifact.index["tensors"]), tied, kv_token, context_len,
                       f"params/index.json weights ({embedding_note}) + {kv_dtype} KV cache of "
                       f"{context_len} tokens")


def gguf_read_bytes(path: str | Path, context_len: int, kv_dtype_bytes: int = 2) -> ReadBytes:
    """Bytes one llama.cpp decode step of a GGUF model reads at `context_len`: every tensor (token_embd as one
    row when there is an output.weight, else whole: it is the output layer too) and a KV cache of
    `kv_dtype_bytes` per value (llama.cpp's default cache type is f16)."""
    from .loaders.gguf_file import GGUFFile  # pylint: disable=import-outside-toplevel

    try:
        reader = GGUFFile(path)
    except (OSError, ValueError) as err:  # GGUFFormatError is a ValueError
        raise MobilecError(f"cannot read GGUF {path}: {err}") from None

    def field(key: str, default=None):
        return reader.fields.get(key, default)

    arch = field("general.architecture")
    heads = field(f"{arch}.attention.head_count")
    key_len = field(f"{arch}.attention.key_length", field(f"{arch}.embedding_length") // heads)
    kv_token = kv_bytes_per_token(field(f"{arch}.block_count"), field(f"{arch}.attention.head_count_kv", heads),
                                  key_len, field(f"{arch}.attention.value_length", key_len), kv_dtype_bytes)
    tied = "output.weight" not in {t.name for t in reader.tensors}
    # GGUF shapes are [ne0 = hidden, ne1 = vocab]: the rows of token_embd are its last dimension
    return decode_read(((t.name == "token_embd.weight", int(t.n_bytes), int(t.shape[-1])) for t in reader.tensors),
                       tied, kv_token, context_len,
                       f"GGUF tensors ({'no output.weight: token_embd read whole' if tied else 'token_embd: one row'})"
                       f" + {8 * kv_dtype_bytes}-bit KV cache of {context_len} tokens")
