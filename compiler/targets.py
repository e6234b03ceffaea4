"""Load and validate the declarative target files in targets/*.toml."""

from __future__ import annotations

import dataclasses
import hashlib
import tomllib
from pathlib import Path
from typing import Any

import tvm

from .errors import MobilecError
from .schedules import gpu as gpu_schedules

TARGETS_DIR = Path(__file__).resolve().parent.parent / "targets"
# native: this machine's C compiler; cross: a cross compiler on PATH; ndk: the Android NDK, or a .tar of
# objects without one; hexagon: Hexagon DSP objects, linked only with the Hexagon SDK.
LINK_METHODS = ("native", "cross", "ndk", "hexagon")
LINK_FIELDS = {"cross": {"compiler": str, "package": str}, "ndk": {"ndk_api": int}}
SCHEDULE_RULES = ("cpu", "gpu")
REQUIRED_DEVICE_FIELDS = {
    "memory_bandwidth_gbs": float,
    "ram_gb": float,
    "max_alloc_gb": float,  # largest single buffer
    "default_quant": str,
    "compute_dtype": str,  # activations of quantized models
}
# GPU limits, and the TVM target attribute each becomes: the file states a limit once, dlight sizes kernels
# by the attribute, and passes/verify_device_limits.py checks every kernel against it.
GPU_LIMIT_FIELDS = {
    "max_threads_per_group": "max_num_threads",
    "local_memory_bytes": "max_shared_memory_per_block",
    "max_kernel_args": "max_function_args",
}


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    name: str
    description: str
    path: Path
    sha256: str  # of the file's bytes: an artifact records exactly what it was built for
    tvm_target_json: dict[str, Any]
    link: dict[str, Any]  # method, and that method's fields
    schedule: dict[str, Any]
    device: dict[str, Any]

    def tvm_target(self) -> tvm.target.Target:
        return tvm.target.Target(self.tvm_target_json)

    def model_target(self) -> tvm.target.Target:
        """The target a model is exported under, which picks the KV cache's attention kernels: on Hexagon
        those run on the host CPU (the KV cache's C++ code launches them), so they are made for the host."""
        target = self.tvm_target()
        return target.host if target.kind.name == "hexagon" else target


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
    if not isinstance(node, kind) or (kind is int and isinstance(node, bool)):
        raise MobilecError(f"target file {path}: field '{dotted}' must be a {kind.__name__}, got {node!r}")
    return node


def _choice(value: str, choices: tuple[str, ...], dotted: str, path: Path) -> str:
    if value not in choices:
        raise MobilecError(f"target file {path}: '{dotted}' is {value!r}; valid: {', '.join(choices)}")
    return value


def _check_gpu_fields(table: dict[str, Any], path: Path) -> None:
    for key in GPU_LIMIT_FIELDS:
        if _field(table, f"device.{key}", path, int) <= 0:
            raise MobilecError(f"target file {path}: field 'device.{key}' must be positive")
    for section, fields in gpu_schedules.PARAMETERS.items():
        given = _field(table, f"schedule.{section}", path, dict)
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise MobilecError(f"target file {path}: unknown field 'schedule.{section}.{unknown[0]}'; "
                               f"valid: {', '.join(fields)}")
        for key, kind in fields.items():
            _field(table, f"schedule.{section}.{key}", path, kind)
    _choice(table["schedule"]["gemv"]["row_threads"], gpu_schedules.ROW_THREAD_TAGS, "schedule.gemv.row_threads", path)


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
    tvm_json = dict(_field(table, "tvm.target", path, dict))
    _field(table, "tvm.target.kind", path, str)
    device = _field(table, "device", path, dict)
    for key, kind in REQUIRED_DEVICE_FIELDS.items():
        _field(table, f"device.{key}", path, kind)
    link_method = _choice(_field(table, "link.method", path, str), LINK_METHODS, "link.method", path)
    for key, kind in LINK_FIELDS.get(link_method, {}).items():
        _field(table, f"link.{key}", path, kind)
    rules = _choice(_field(table, "schedule.rules", path, str), SCHEDULE_RULES, "schedule.rules", path)
    if rules == "gpu":
        _check_gpu_fields(table, path)
        tvm_json.update({attr: device[key] for key, attr in GPU_LIMIT_FIELDS.items()})
    spec = TargetSpec(
        name=_field(table, "name", path, str),
        description=_field(table, "description", path, str),
        path=path,
        sha256=hashlib.sha256(raw).hexdigest(),
        tvm_target_json=tvm_json,
        link=_field(table, "link", path, dict),
        schedule=_field(table, "schedule", path, dict),
        device=device,
    )
    try:
        spec.tvm_target()
    except Exception as err:  # TVM raises several error types for bad target JSON
        raise MobilecError(f"target file {path}: TVM rejects [tvm].target: {str(err).splitlines()[0]}") from None
    return spec
