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

from ..errors import MobilecError

# 2: the config lists every file of the artifact with its size and sha256 ("files"), the library included.
FORMAT_VERSION = 3
CONFIG_FILE = "mobilec-config.json"
LIBRARY_DIR = "lib"
PARAMS_DIR = "params"
PARAMS_INDEX = "params/index.json"
TOKENIZER_DIR = "tokenizer"
ALIGNMENT = 64  # bytes; every tensor in a shard starts on this boundary so it can be mapped without a copy
SHARD_BYTES = 32 * 1024 * 1024
# In every temporary directory a compile writes into (compiler/artifacts/export.py), never in a finished artifact.
PARTIAL_MARKER = ".mobilec-partial"
# What the top level of an artifact holds; an artifact written before its config listed its files has no more.
TOP_LEVEL = (CONFIG_FILE, LIBRARY_DIR, PARAMS_DIR, TOKENIZER_DIR)


def installed_versions() -> dict[str, str]:
    return {pkg: metadata.version(pkg) for pkg in ("mobilec", "apache-tvm", "apache-tvm-ffi")}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _relative_files(root: Path) -> list[str]:
    """Every file and link below root, as POSIX paths relative to it, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink())


def file_manifest(root: Path, known_sha256: dict[str, str] | None = None,
                  names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """The config's "files": every file of the artifact (or only `names`) but the config itself, with its size and
    sha256 (`known_sha256`: digests already computed while writing, e.g. the weight shards')."""
    known = known_sha256 or {}
    manifest = {}
    for name in _relative_files(root) if names is None else names:
        if name in (CONFIG_FILE, PARTIAL_MARKER):
            continue
        path = root / name
        manifest[name] = {"bytes": path.stat().st_size, "sha256": known.get(name) or sha256_file(path)}
    return manifest


def foreign_files(root: Path) -> list[str] | None:
    """None when `root` holds no mobilec artifact (no readable config naming its format); else the entries in it
    that are not the artifact's (files a user put there), which replacing the artifact would delete."""
    try:
        config = json.loads((root / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(config, dict) or "format_version" not in config:
        return None
    listed = config.get("files")
    if isinstance(listed, dict):
        return [name for name in _relative_files(root) if name != CONFIG_FILE and name not in listed]
    return sorted(p.name for p in root.iterdir() if p.name not in TOP_LEVEL)


def _inside(root: Path, name: Any) -> bool:
    """A manifest name is a plain relative path that stays inside the artifact."""
    return (isinstance(name, str) and bool(name) and not Path(name).is_absolute()
            and ".." not in Path(name).parts and "\\" not in name)


def _check_files(root: Path, config: dict[str, Any], verify_checksums: bool) -> None:
    """Every file the config lists is there with its size and (if `verify_checksums`) its sha256: a truncated or
    modified library is refused here, before anything loads it (a short .so kills the process with SIGBUS)."""
    listed = config.get("files")
    if not isinstance(listed, dict) or not all(_inside(root, n) and isinstance(e, dict) for n, e in listed.items()):
        raise MobilecError(f"{root / CONFIG_FILE} has no valid list of the artifact's files; recompile the artifact")
    library = config.get("library")
    for name in (library, PARAMS_INDEX):
        if name not in listed:
            raise MobilecError(f"{root / CONFIG_FILE} does not list {name!r} among the artifact's files; recompile "
                               f"the artifact")
    for name, entry in listed.items():
        path = root / name
        what = "weight shard" if name.startswith(f"{PARAMS_DIR}/shard_") else "compiled library" \
            if name == library else "file"
        if not path.is_file():
            raise MobilecError(f"{what} {path} is missing; recompile the artifact")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise MobilecError(f"{what} {path} has {size} bytes, the artifact lists {entry.get('bytes')} (truncated "
                               f"or modified); recompile the artifact")
        if verify_checksums and sha256_file(path) != entry.get("sha256"):
            raise MobilecError(f"{what} {path} fails its sha256 check (corrupted or modified); recompile the artifact")


def _check_config_values(root: Path, config: dict[str, Any]) -> None:
    """The numbers the runtime sizes the KV cache by: positive whole numbers (a hand-edited config may not)."""
    for key in ("context_window", "prefill_chunk", "page_size"):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MobilecError(f"{root / CONFIG_FILE}: {key!r} must be a positive whole number, got {value!r}; "
                               f"recompile the artifact")


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
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise MobilecError(f"{path.parent} is not a mobilec artifact: {what} is missing; run `mobilec compile` first") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MobilecError(f"{path} is corrupt (not JSON); recompile the artifact with `mobilec compile`") from None
    except OSError as err:
        raise MobilecError(f"cannot read {path}: {err.strerror or err}") from None
    if not isinstance(value, dict):
        raise MobilecError(f"{path} is corrupt (not a JSON object); recompile the artifact with `mobilec compile`")
    return value


def load_artifact(path: str | Path, verify_checksums: bool = True) -> Artifact:
    """Open an artifact; refuse one built by other versions, or with a file missing, cut short or changed (every
    file is checked against the sizes and sha256s its config lists; `verify_checksums=False` checks sizes only)."""
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
    if not _inside(root, config.get("library")):
        raise MobilecError(f"{root / CONFIG_FILE} names no library inside the artifact; recompile the artifact")
    _check_files(root, config, verify_checksums)
    _check_config_values(root, config)
    index = _read_json(root / PARAMS_INDEX, PARAMS_INDEX)
    for shard in index.get("shards", []):
        if f"{PARAMS_DIR}/{shard.get('file')}" not in config["files"]:
            raise MobilecError(f"weight shard {root / PARAMS_DIR / str(shard.get('file'))} is not among the "
                               f"artifact's files; recompile the artifact")
    return Artifact(root, config, index)
