"""Whether a CPU can run an artifact's code: the artifact records the CPU it needs (mobilec-config.json's "cpu":
architecture and the instruction-set features its target enabled), and a CPU of another architecture, or one
that lacks a feature, is refused with one line before the library is loaded (code using a missing feature would
die on an illegal instruction, SIGILL, and take the whole process with it)."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import tvm

from ..errors import MobilecError
from .isa import CpuIsa, arch_of_triple, code_cpu_isa, missing_features


def cpu_entry(isa: CpuIsa | None) -> dict[str, Any] | None:
    """The config's "cpu": what the CPU running a target's code (isa.code_cpu_isa) must be; None where no CPU code
    is built."""
    if isa is None:
        return None
    return {"arch": isa.arch, "required_features": isa.required_features, "isa": isa.describe()}


def artifact_cpu(config: dict[str, Any]) -> dict[str, Any] | None:
    """The CPU an artifact needs: its config's "cpu", or, for an artifact written before that entry, what its
    recorded TVM target implies."""
    if "cpu" in config:
        return config["cpu"]
    try:
        return cpu_entry(code_cpu_isa(tvm.target.Target(config["target"]["tvm_target"])))
    except Exception:  # noqa: BLE001  a target this TVM cannot parse: nothing to compare
        return None


@dataclasses.dataclass(frozen=True)
class Cpu:
    """A CPU an artifact may run on, as far as it is known."""

    name: str  # for messages: "this CPU (AMD EPYC, znver3)", "the RPC server at 10.0.0.2:9090"
    arch: str | None  # "x86_64", "aarch64"; None when unknown
    features: frozenset[str] | None  # LLVM feature names it has; None when unknown
    local: bool = False  # this machine: `--target host` builds for it


def this_cpu() -> Cpu:
    """The CPU of this machine (compiler/target/host.py: LLVM's name for it, features cut to /proc/cpuinfo's flags)."""
    from . import host  # pylint: disable=import-outside-toplevel  # host imports tvm's LLVM helpers

    target = host.host_target_json()
    return Cpu(f"this CPU ({host.cpu_model_name()}, {target['mcpu']})", arch_of_triple(target["mtriple"]),
               host.host_features(), local=True)


def _fixed_cpu_targets() -> dict[str, dict[str, Any]]:
    """The "cpu" entry of every target file with a fixed LLVM CPU target (not "detect", not a GPU)."""
    from .targets import available_targets  # pylint: disable=import-outside-toplevel  # targets imports host

    found = {}
    for name, path in available_targets().items():
        try:
            target = tomllib.loads(Path(path).read_text())["tvm"]["target"]
            if isinstance(target, dict) and target.get("kind") == "llvm":
                found[name] = cpu_entry(code_cpu_isa(tvm.target.Target(target)))
        except Exception:  # noqa: BLE001, S112  a broken file is load_target's to report
            continue
    return {name: entry for name, entry in found.items() if entry}


def suitable_targets(cpu: Cpu) -> list[str]:
    """Targets whose code `cpu` runs: `host` for this machine, then the fixed CPU targets of its architecture
    that need no feature it lacks (all of that architecture when its features are unknown)."""
    names = ["host"] if cpu.local else []
    for name, entry in _fixed_cpu_targets().items():
        if name != "host" and entry["arch"] == cpu.arch and (
                cpu.features is None or not missing_features(entry["required_features"], cpu.features)):
            names.append(name)
    return names


def _rebuild_hint(cpu: Cpu) -> str:
    names = suitable_targets(cpu)
    if names:
        return "recompile with " + " or ".join(f"--target {n}" for n in names)
    return f"recompile with a --target for {cpu.arch or 'that device'}"


def check_cpu(artifact_path: str | Path, config: dict[str, Any], cpu: Cpu) -> dict[str, Any]:
    """Refuse an artifact whose code `cpu` cannot run (another architecture, or a required feature missing), as far
    as `cpu` is known; returns what was checked (for reports such as bench's JSON). A hexagon-npu artifact built
    without --host-target holds the DSP's kernels alone: no CPU runs it."""
    recorded = config.get("target", {})
    if recorded.get("tvm_target", {}).get("kind") == "hexagon" and "host_target" not in recorded.get("overrides", {}):
        raise MobilecError(f"{artifact_path} holds only the NPU's kernels (compiled without --host-target), no code "
                           f"that runs here; recompile it with --host-target host to run its NPU kernels on the "
                           f"emulated Hexagon DSP")
    need = artifact_cpu(config)
    done = {"required": need, "arch_checked": False, "features_checked": False}
    if need is None:
        return done
    target = recorded.get("name", "?")
    if cpu.arch is not None:
        done["arch_checked"] = True
        if need["arch"] != cpu.arch:
            raise MobilecError(f"{artifact_path} is built for {need['arch']} (target {target}) but {cpu.name} is "
                               f"{cpu.arch}: {_rebuild_hint(cpu)}")
    if cpu.features is not None and done["arch_checked"]:
        done["features_checked"] = True
        missing = sorted(missing_features(need["required_features"], cpu.features))
        if missing:
            raise MobilecError(f"{artifact_path} is built for a CPU with {', '.join(missing)} (target {target}); "
                               f"{cpu.name} lacks {'it' if len(missing) == 1 else 'them'}: {_rebuild_hint(cpu)}")
    return done
