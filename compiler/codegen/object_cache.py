"""CPU kernels' machine code kept on disk (user_cache's `objects/`): each PrimFunc of an LLVM target is built into an
object file of its own, keyed by the function's structure, its symbol, the target, the build settings and the
toolchain, so that a later compile that lowers a kernel to the same TIR links the kept object instead of running
LLVM again.

LLVM was two thirds of a tiny model's host compile (a tiny Llama, q4f16_g32, one thread: 13 of 20 s); a real model
has as few distinct kernels (one per shape), so a second compile of the same shapes, with another context window,
KV cache or quantization of some layers, builds only the kernels that changed. Building each kernel alone also gives
each its own `tirx.noalias` (TVM 0.27's codegen takes the module's last one for all: passes/mark_noalias.py).
GPU targets keep one module: their device kernels must stay one OpenCL program."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import tvm
from tvm import tirx
from tvm_ffi.structural import structural_hash

from ..user_cache import cache_path, drop_older_folders, keep_file

KEPT_BYTES = 1 << 30  # the oldest objects beyond this are deleted after a compile that added some
KEPT_TOOLCHAINS = 2  # other TVM/LLVM versions' folders kept (a developer moving between two environments)
ANCHOR = "mobilec_kept_objects"


def applies(target: tvm.target.Target) -> bool:
    """Kernels compiled by LLVM for the CPU itself (no device code besides)."""
    return target.kind.name == "llvm"


def _toolchain_folder() -> Path:
    return cache_path("objects", f"tvm-{tvm.__version__}-llvm-{tvm.target.codegen.llvm_version_major()}")


def _settings(target: tvm.target.Target, limits: dict) -> str:
    """Everything besides the kernel that its object depends on: the target, the pass context (tirx.build's
    pipeline reads its options) and the device limits its build verifies."""
    context = tvm.transform.PassContext.current()
    config = {str(k): str(v) for k, v in context.config.items()}
    return json.dumps([str(target), context.opt_level, config, limits], sort_keys=True, default=str)


def as_objects(lowered: tvm.IRModule, target: tvm.target.Target, limits: dict) -> tvm.IRModule:
    """`lowered` with each PrimFunc as an object file (kept, or built here and kept) among the module's
    `external_mods`, which tvm.compile links into the library; `lowered` itself where the cache cannot be written."""
    folder = _toolchain_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return lowered
    settings = _settings(target, limits)
    objects, rest, built = [], {}, False
    for gv, func in lowered.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            rest[gv] = func
            continue
        symbol = str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else gv.name_hint
        key = hashlib.sha256(f"{settings}\0{symbol}\0{structural_hash(func)}".encode()).hexdigest()[:32]
        path = folder / f"{key}.o"
        if not _kept(path):
            if not keep_file(path, tvm.tirx.build(tvm.IRModule({gv: func}), target=target).write_to_file):
                return lowered
            built = True
        objects.append(tvm.runtime.load_static_library(str(path), [symbol]))
    if built:
        _trim(folder)
    # One kernel left for tvm.compile to build, an empty one: the library's own LLVM module, from which TVM's export
    # takes the target triple of the object that packs the imports (without it: the build machine's).
    rest[tvm.ir.GlobalVar(ANCHOR)] = tirx.PrimFunc([], tirx.Evaluate(0)).with_attr("global_symbol", ANCHOR)
    external = list(lowered.attrs["external_mods"]) if lowered.attrs and "external_mods" in lowered.attrs else []
    return tvm.IRModule(rest, attrs=lowered.attrs).with_attr("external_mods", external + objects)


def _kept(path: Path) -> bool:
    """Whether the object is there, marked used now (the last to be trimmed)."""
    try:
        os.utime(path)
        return True
    except OSError:  # not built yet, or trimmed by another compile a moment ago
        return False


def _trim(folder: Path) -> None:
    """Delete the least recently used objects beyond KEPT_BYTES, and other toolchains' folders beyond
    KEPT_TOOLCHAINS."""
    drop_older_folders(folder, KEPT_TOOLCHAINS)
    try:
        objects = sorted(((p.stat().st_mtime, p.stat().st_size, p) for p in folder.glob("*.o")), reverse=True)
        total = 0
        for _, size, path in objects:
            total += size
            if total > KEPT_BYTES:
                path.unlink(missing_ok=True)
    except OSError:  # another compile trimmed first
        pass
