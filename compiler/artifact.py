"""The artifact directory's layout, and reading one back with its versions and checksums verified."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from .errors import MobilecError

FORMAT_VERSION = 1
CONFIG_FILE = "mobilec-config.json"
LIBRARY_DIR = "lib"
PARAMS_DIR = "params"
PARAMS_INDEX = "params/index.json"
TOKENIZER_DIR = "tokenizer"
ALIGNMENT = 64  # bytes; every tensor in a shard starts on this boundary so it can be mapped without a copy
SHARD_BYTES = 32 * 1024 * 1024


def installed_versions() -> dict[str, str]:
    return {pkg: metadata.version(pkg) for pkg in ("mobilec", "apache-tvm", "apache-tvm-ffi")}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclasses.dataclass
class Artifact:
    path: Path
    config: dict[str, Any]
    index: dict[str, Any]

    @property
    def library(self) -> Path:
        return self.path / self.config["library"]

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / TOKENIZER_DIR

    def load_params(self) -> Iterator[np.ndarray]:
        """The parameters in the order the compiled functions take them, memory-mapped from the shards. One shard
        is mapped at a time: a caller that copies each array and drops it never holds more than one shard's pages
        (a list of all the maps kept the whole file resident while the copies were made: +680 MB peak RSS, 1B model)."""
        current, mapped = None, None
        for entry in self.index["tensors"]:
            if entry["shard"] != current:
                current = entry["shard"]
                mapped = np.memmap(self.path / PARAMS_DIR / current, dtype=np.uint8, mode="r")
            raw = mapped[entry["offset"] : entry["offset"] + entry["nbytes"]]
            yield raw.view(entry["dtype"]).reshape(entry["shape"])


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise MobilecError(f"{path.parent} is not a mobilec artifact: {what} is missing; run `mobilec compile` first") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MobilecError(f"{path} is corrupt (not JSON); recompile the artifact with `mobilec compile`") from None


def load_artifact(path: str | Path, verify_checksums: bool = True) -> Artifact:
    """Open an artifact; refuse one built by other versions or with damaged weight shards."""
    root = Path(path)
    if not root.is_dir():
        raise MobilecError(f"artifact directory {root} does not exist; run `mobilec compile` to create it")
    config = _read_json(root / CONFIG_FILE, CONFIG_FILE)
    if config.get("format_version") != FORMAT_VERSION:
        raise MobilecError(f"{root} has artifact format {config.get('format_version')}, this mobilec reads {FORMAT_VERSION}; recompile it")
    built_with = config.get("versions", {})
    mismatched = [f"{pkg} {built_with.get(pkg)} (installed {have})" for pkg, have in installed_versions().items() if built_with.get(pkg) != have]
    if mismatched:
        raise MobilecError(f"{root} was built with {', '.join(mismatched)}; recompile it with this installation")
    index = _read_json(root / PARAMS_INDEX, PARAMS_INDEX)
    if verify_checksums:
        for shard in index["shards"]:
            shard_path = root / PARAMS_DIR / shard["file"]
            if not shard_path.is_file():
                raise MobilecError(f"weight shard {shard_path} is missing; recompile the artifact")
            if sha256_file(shard_path) != shard["sha256"]:
                raise MobilecError(f"weight shard {shard_path} fails its sha256 check (corrupted or modified); recompile the artifact")
    artifact = Artifact(root, config, index)
    if not artifact.library.is_file():
        raise MobilecError(f"compiled library {artifact.library} is missing; recompile the artifact")
    return artifact
