"""Load and validate the declarative target files in targets/*.toml."""

from __future__ import annotations

import dataclasses
import hashlib
import tomllib
from pathlib import Path
from typing import Any

import tvm

from . import host
from .data_files import data_dir
from .errors import MobilecError
from .schedules import gpu as gpu_schedules

TARGETS_DIR = data_dir("targets")
# Values a target file may leave to the machine it is loaded on (targets/host.toml): the CPU ([tvm] target),
# its memory bandwidth (measured once and cached) and its RAM (read from the system).
DETECT = "detect"
MEASURE = "measure"
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
    if kind is float and isinstance(node, int) and not isinstance(node, bool):
        node = float(node)
    if not isinstance(node, kind) or (kind is int and isinstance(node, bool)):
        raise MobilecError(f"target file {path}: field '{dotted}' must be a {kind.__name__}, got {node!r}")
    if kind is float and not 0 < node < float("inf"):
        raise MobilecError(f"target file {path}: field '{dotted}' must be a positive number, got {node!r}")
    return node


def _resolve_machine_values(table: dict[str, Any], path: Path) -> None:
    """Fill in what the file leaves to this machine: [tvm] target = "detect", and device values "measure" (memory
    bandwidth) or "detect" (RAM, largest buffer)."""
    tvm_table = table.get("tvm")
    if isinstance(tvm_table, dict) and tvm_table.get("target") == DETECT:
        tvm_table["target"] = dict(host.host_target_json())
    device = table.get("device")
    if not isinstance(device, dict):
        return
    machine = {"memory_bandwidth_gbs": (MEASURE, host.host_bandwidth_gbs), "ram_gb": (DETECT, host.ram_gb),
               "max_alloc_gb": (DETECT, host.ram_gb)}
    for key, (word, read) in machine.items():
        if isinstance(device.get(key), str):
            if device[key] != word:
                raise MobilecError(f"target file {path}: field 'device.{key}' is {device[key]!r}; give a number "
                                   f"or \"{word}\" (this machine's)")
            device[key] = round(float(read()), 2)


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


def _check_llvm_cpu(tvm_json: dict[str, Any], path: Path) -> None:
    """An LLVM CPU name LLVM does not know would only print a page of warnings and build for a generic CPU."""
    for part in (tvm_json, tvm_json.get("host")):
        if not isinstance(part, dict) or part.get("kind") != "llvm" or "mcpu" not in part:
            continue
        triple = str(part.get("mtriple") or tvm.target.codegen.llvm_get_system_triple())
        if not tvm.target.codegen.llvm_is_valid_cpu(str(part["mcpu"]), triple):
            raise MobilecError(f"target file {path}: LLVM knows no CPU {part['mcpu']!r} for {triple}; use one "
                               f"`llc -mtriple={triple} -mcpu=help` lists (e.g. x86-64-v3, cortex-a76)")


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
    _resolve_machine_values(table, path)
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
    _check_llvm_cpu(tvm_json, path)
    try:
        spec.tvm_target()
    except Exception as err:  # TVM raises several error types for bad target JSON
        raise MobilecError(f"target file {path}: TVM rejects [tvm].target: {str(err).splitlines()[0]}") from None
    return spec
