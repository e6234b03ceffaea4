"""Load and validate the declarative target files in targets/*.toml."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import tvm

from .. import validate
from ..choices import DECODE_ACTIVATIONS, KV_DTYPE_NAMES
from ..data_files import data_dir
from ..errors import MobilecError
from ..quantization.schemes import SCHEMES
from ..schedules import gpu as gpu_schedules
from . import host

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
# [device.cpu]: the cores of an ARM SoC (informational: bench/arm_gemv_mca.py models its big and little cores)
CPU_CORE_FIELDS = {"big": str, "big_count": int, "big_ghz": float, "little": str, "little_count": int,
                   "little_ghz": float}
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
    overrides: dict[str, str] = dataclasses.field(default_factory=dict)  # with_overrides: what differs from the file

    def tvm_target(self) -> tvm.target.Target:
        return tvm.target.Target(self.tvm_target_json)

    @property
    def decode_activations(self) -> str:
        """The integer width of decode GEMV activations compile uses unless asked (--decode-activations): the file's
        device.decode_activations, else int16 (the float model's results to ~2e-5)."""
        return self.device.get("decode_activations", DECODE_ACTIVATIONS[0])

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
    # Numbers in a target file are sizes, limits, rates and tile sizes: every one is positive.
    if kind is float:
        validate.positive_number(node, f"target file {path}: field '{dotted}'")
    if kind is int:
        validate.count(node, f"target file {path}: field '{dotted}'")
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
        _field(table, f"device.{key}", path, int)
    for section, fields in gpu_schedules.PARAMETERS.items():
        given = _field(table, f"schedule.{section}", path, dict)
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise MobilecError(f"target file {path}: unknown field 'schedule.{section}.{unknown[0]}'; "
                               f"valid: {', '.join(fields)}")
        for key, kind in fields.items():
            _field(table, f"schedule.{section}.{key}", path, kind)
    _choice(table["schedule"]["gemv"]["row_threads"], gpu_schedules.ROW_THREAD_TAGS, "schedule.gemv.row_threads", path)


def _check_no_unknown_fields(table: dict[str, Any], path: Path, link_method: str, rules: str) -> None:
    """A field we do not read (a typo such as `memory_bandwith_gbs`, an option of another version) is refused: a
    target file that silently means something other than it says builds the wrong library."""
    device_fields = {*REQUIRED_DEVICE_FIELDS, "cpu", "kv_dtype", "decode_activations",
                     *(GPU_LIMIT_FIELDS if rules == "gpu" else ())}
    known = {"": {"name", "description", "tvm", "link", "schedule", "device"}, "tvm": {"target"},
             "link": {"method", *LINK_FIELDS.get(link_method, {})},
             "schedule": {"rules", *(gpu_schedules.PARAMETERS if rules == "gpu" else ())},
             "device": device_fields, "device.cpu": set(CPU_CORE_FIELDS)}
    for dotted, fields in known.items():
        node = table
        for part in filter(None, dotted.split(".")):
            node = node.get(part, {})
        unknown = sorted(set(node) - fields) if isinstance(node, dict) else []
        if unknown:
            where = f"{dotted}.{unknown[0]}" if dotted else unknown[0]
            raise MobilecError(f"target file {path}: unknown field '{where}'; valid there: {', '.join(sorted(fields))}")
    if "cpu" in table["device"]:
        for key, kind in CPU_CORE_FIELDS.items():
            _field(table, f"device.cpu.{key}", path, kind)


def _check_device_values(device: dict[str, Any], path: Path) -> None:
    """The [device] values that are names (a quantization scheme, a dtype) or bounded by one another."""
    validate.choice(device["default_quant"], tuple(SCHEMES), f"target file {path}: field 'device.default_quant'")
    validate.compute_dtype(device["compute_dtype"], f"target file {path}: field 'device.compute_dtype'")
    if "kv_dtype" in device:  # what compile --kv-dtype auto picks (kv_cache_dtype.py)
        validate.choice(device["kv_dtype"], KV_DTYPE_NAMES, f"target file {path}: field 'device.kv_dtype'")
    if "decode_activations" in device:  # what compile picks without --decode-activations
        validate.choice(device["decode_activations"], DECODE_ACTIVATIONS,
                        f"target file {path}: field 'device.decode_activations'")
    if device["max_alloc_gb"] > device["ram_gb"]:
        raise MobilecError(f"target file {path}: field 'device.max_alloc_gb' ({device['max_alloc_gb']:g}) is more "
                           f"than 'device.ram_gb' ({device['ram_gb']:g}); one buffer cannot exceed the RAM")


@contextlib.contextmanager
def _quiet_stderr():
    """LLVM prints its warnings (an unknown feature) straight to file descriptor 2; keep them off the user's screen."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w", encoding="utf-8") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _llvm_knows_feature(triple: str, feature: str) -> bool:
    """Whether LLVM knows `feature` for `triple`: enabled alone, an unknown one is dropped (with a warning)."""
    target = tvm.target.Target({"kind": "llvm", "mtriple": triple, "mattr": [f"+{feature}"]})
    with _quiet_stderr():
        return feature in {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(target)}


def _check_llvm_cpu(tvm_json: dict[str, Any], path: Path) -> None:
    """An LLVM CPU name or feature LLVM does not know would only print a page of warnings and build for a generic
    CPU (or without the feature); num-cores is a thread count."""
    for where, part in (("tvm.target", tvm_json), ("tvm.target.host", tvm_json.get("host"))):
        if not isinstance(part, dict) or part.get("kind") != "llvm":
            continue
        triple = str(part.get("mtriple") or tvm.target.codegen.llvm_get_system_triple())
        if "mcpu" in part and not tvm.target.codegen.llvm_is_valid_cpu(str(part["mcpu"]), triple):
            raise MobilecError(f"target file {path}: LLVM knows no CPU {part['mcpu']!r} for {triple}; use one "
                               f"`llc -mtriple={triple} -mcpu=help` lists (e.g. x86-64-v3, cortex-a76)")
        mattr = part.get("mattr", [])
        if not isinstance(mattr, list) or not all(isinstance(f, str) and f[:1] in "+-" and f[1:] for f in mattr):
            raise MobilecError(f"target file {path}: field '{where}.mattr' must be a list of \"+feature\" or "
                               f"\"-feature\" strings, got {mattr!r}")
        unknown = [f for f in mattr if not _llvm_knows_feature(triple, f[1:])]
        if unknown:
            raise MobilecError(f"target file {path}: LLVM knows no feature {unknown[0][1:]!r} for {triple} (in "
                               f"'{where}.mattr'); use one `llc -mtriple={triple} -mattr=help` lists (e.g. avx2, "
                               f"dotprod)")
        if "num-cores" in part:
            validate.count(part["num-cores"], f"target file {path}: field '{where}.num-cores'")


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
    _check_device_values(device, path)
    link_method = _choice(_field(table, "link.method", path, str), LINK_METHODS, "link.method", path)
    for key, kind in LINK_FIELDS.get(link_method, {}).items():
        _field(table, f"link.{key}", path, kind)
    rules = _choice(_field(table, "schedule.rules", path, str), SCHEDULE_RULES, "schedule.rules", path)
    _check_no_unknown_fields(table, path, link_method, rules)
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


def with_overrides(spec: TargetSpec, host_target: str | None = None, compute_dtype: str | None = None) -> TargetSpec:
    """`spec` with its host side built for another target file's CPU (`host_target`: its TVM target and how it
    links; the device kernels unchanged) and/or another compute dtype: how a phone's GPU artifact runs on this
    machine (PoCL has no fp16, and this machine is not an aarch64 phone), and a Hexagon artifact with its NPU
    kernels on the emulated DSP (codegen/hexagon.py). The artifact records both."""
    if host_target is None and compute_dtype is None:
        return spec
    overrides: dict[str, str] = {}
    tvm_json, link, device = dict(spec.tvm_target_json), spec.link, dict(spec.device)
    if host_target is not None:
        if "host" not in tvm_json:
            raise MobilecError(f"--host-target applies to GPU and NPU targets, whose host side runs on a CPU; "
                               f"{spec.name} is a {tvm_json['kind']} target: drop the option")
        host_spec = load_target(host_target)
        if host_spec.tvm_target_json["kind"] != "llvm":
            raise MobilecError(f"--host-target {host_target} is a {host_spec.tvm_target_json['kind']} target; pass a "
                               f"CPU target file (host, linux-arm64, x86-64-v3, ...)")
        tvm_json["host"] = dict(host_spec.tvm_target_json)
        link = host_spec.link
        overrides["host_target"] = host_spec.name
    if compute_dtype is not None:
        device["compute_dtype"] = validate.compute_dtype(compute_dtype, "--compute-dtype")
        overrides["compute_dtype"] = compute_dtype
    return dataclasses.replace(spec, tvm_target_json=tvm_json, link=link, device=device,
                               overrides={**spec.overrides, **overrides})
