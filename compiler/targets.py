"""Load and validate the declarative target files in targets/*.toml."""

from __future__ import annotations

import dataclasses
import hashlib
import tomllib
from pathlib import Path
from typing import Any

import tvm

from .errors import MobilecError

TARGETS_DIR = Path(__file__).resolve().parent.parent / "targets"
LINK_METHODS = ("native",)
SCHEDULE_RULES = ("cpu",)
REQUIRED_DEVICE_FIELDS = {
    "memory_bandwidth_gbs": float,
    "ram_gb": float,
    "max_alloc_gb": float,
    "default_quant": str,
    "compute_dtype": str,  # activations of quantized models
}


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    name: str
    description: str
    path: Path
    sha256: str  # of the file's bytes: an artifact records exactly what it was built for
    tvm_target_json: dict[str, Any]
    link_method: str
    schedule: dict[str, Any]
    device: dict[str, Any]

    def tvm_target(self) -> tvm.target.Target:
        return tvm.target.Target(self.tvm_target_json)


def available_targets() -> dict[str, Path]:
    return {p.stem: p for p in sorted(TARGETS_DIR.glob("*.toml"))}


def _field(table: dict[str, Any], dotted: str, path: Path, kind: type) -> Any:
    node: Any = table
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise MobilecError(f"target file {path} lacks the field '{dotted}'; add it (see targets/host.toml)")
        node = node[part]
    if kind is float and isinstance(node, int):
        node = float(node)
    if not isinstance(node, kind):
        raise MobilecError(f"target file {path}: field '{dotted}' must be a {kind.__name__}, got {node!r}")
    return node


def _choice(value: str, choices: tuple[str, ...], dotted: str, path: Path) -> str:
    if value not in choices:
        raise MobilecError(f"target file {path}: '{dotted}' is {value!r}; valid: {', '.join(choices)}")
    return value


def load_target(name_or_path: str) -> TargetSpec:
    """A target by name (a file in targets/) or by the path of a .toml file."""
    known = available_targets()
    path = known.get(name_or_path)
    if path is None:
        candidate = Path(name_or_path)
        if candidate.suffix == ".toml" and candidate.is_file():
            path = candidate
        else:
            raise MobilecError(f"unknown target {name_or_path!r}; valid: {', '.join(known)} (or a path to a .toml file)")
    raw = path.read_bytes()
    try:
        table = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise MobilecError(f"target file {path} is not valid TOML: {err}") from None
    tvm_json = _field(table, "tvm.target", path, dict)
    _field(table, "tvm.target.kind", path, str)
    device = _field(table, "device", path, dict)
    for key, kind in REQUIRED_DEVICE_FIELDS.items():
        _field(table, f"device.{key}", path, kind)
    spec = TargetSpec(
        name=_field(table, "name", path, str),
        description=_field(table, "description", path, str),
        path=path,
        sha256=hashlib.sha256(raw).hexdigest(),
        tvm_target_json=tvm_json,
        link_method=_choice(_field(table, "link.method", path, str), LINK_METHODS, "link.method", path),
        schedule=_field(table, "schedule", path, dict),
        device=device,
    )
    _choice(_field(table, "schedule.rules", path, str), SCHEDULE_RULES, "schedule.rules", path)
    try:
        spec.tvm_target()
    except Exception as err:  # TVM raises several error types for bad target JSON
        raise MobilecError(f"target file {path}: TVM rejects [tvm].target: {str(err).splitlines()[0]}") from None
    return spec
