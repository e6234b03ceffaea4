"""`mobilec compile`: checkpoint -> Relax IR -> compiled library + weight shards, as one artifact directory."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from . import pipeline
from .artifact import CONFIG_FILE, FORMAT_VERSION, LIBRARY_DIR, PARAMS_DIR, TOKENIZER_DIR, installed_versions
from .errors import MobilecError
from .export import ShardWriter, atomic_directory
from .loaders import Checkpoint, open_checkpoint
from .loaders.default_model import default_model_path
from .models.registry import family_for
from .quantization.schemes import Scheme, get_scheme
from .targets import TargetSpec, load_target

PAGE_SIZE = 16


def resolve_model_path(model: str | None) -> Path:
    if model in (None, "default"):
        return default_model_path()
    return Path(model)


def model_name(path: Path) -> str:
    return path.stem if path.is_file() else path.resolve().name


def default_output(model_path: Path, quant: str, target: str) -> Path:
    return Path("build") / f"{model_name(model_path)}-{quant}-{target}"


def import_model(ckpt: Checkpoint, scheme: Scheme, spec: TargetSpec, context_window: int | None):
    """Build the nn.Module for the checkpoint's family and export it to a Relax IRModule."""
    family = family_for(ckpt.hf_config)
    cfg = family.config_class.from_hf(ckpt.hf_config, context_window)
    if cfg.context_window_size <= 0:
        raise MobilecError(f"--context-window must be positive, got {cfg.context_window_size}")
    model = family.model_class(cfg)
    model.to(scheme.model_dtype)
    with spec.tvm_target():
        mod, params = model.export_tvm(spec=model.get_default_spec())
    return family, cfg, mod, params


def write_params(ckpt: Checkpoint, sources: dict[str, list[str]], params, scheme: Scheme, out: Path, progress: bool):
    """Convert weights one parameter at a time, so only one tensor is in memory beyond the checkpoint's map."""
    writer = ShardWriter(out / PARAMS_DIR)
    for name, param in tqdm(params, desc="weights", unit="tensor", disable=not progress, file=sys.stderr):
        parts = [ckpt.get(src) for src in sources[name]]
        array = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        if tuple(array.shape) != tuple(int(d) for d in param.shape):
            raise MobilecError(
                f"tensor {name} has shape {tuple(array.shape)} in the checkpoint but the config implies "
                f"{tuple(int(d) for d in param.shape)}; the checkpoint and its config.json disagree"
            )
        writer.add(name, array.astype(param.dtype, copy=False))
    return writer.finish(out)


def compile_model(
    model: str | None,
    target: str,
    quant: str | None,
    output: str | None = None,
    context_window: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Compile and write the artifact; returns a summary (path, timings, sizes)."""
    spec = load_target(target)
    scheme = get_scheme(quant or spec.device["default_quant"])
    model_path = resolve_model_path(model)
    out_dir = Path(output) if output else default_output(model_path, scheme.name, spec.name)
    log = (lambda msg: print(msg, file=sys.stderr)) if progress else (lambda msg: None)
    t_start = time.perf_counter()
    with open_checkpoint(model_path) as ckpt, atomic_directory(out_dir) as tmp:
        log(f"importing {ckpt.description}")
        family, cfg, mod, params = import_model(ckpt, scheme, spec, context_window)
        log(f"compiling {family.name} for {spec.name} ({scheme.name})")
        t_build = time.perf_counter()
        executable = pipeline.build(mod, spec)
        (tmp / LIBRARY_DIR).mkdir()
        library = f"{LIBRARY_DIR}/model.so"
        executable.export_library(str(tmp / library))
        build_seconds = time.perf_counter() - t_build
        index = write_params(ckpt, cfg.param_sources(), params, scheme, tmp, progress)
        ckpt.save_tokenizer(tmp / TOKENIZER_DIR)
        config = {
            "format_version": FORMAT_VERSION,
            "model": {
                "name": model_name(model_path),
                "family": family.name,
                "source": ckpt.description,
                "config": dataclasses.asdict(cfg),
            },
            "quantization": dataclasses.asdict(scheme),
            "target": {
                "name": spec.name,
                "description": spec.description,
                "tvm_target": spec.tvm_target_json,
                "file_sha256": spec.sha256,
            },
            "library": library,
            "context_window": cfg.context_window_size,
            "prefill_chunk": cfg.prefill_chunk_size,
            "page_size": PAGE_SIZE,
            "param_bytes": sum(t["nbytes"] for t in index["tensors"]),
            "versions": installed_versions(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    summary = {
        "artifact": str(out_dir),
        "target": spec.name,
        "quant": scheme.name,
        "build_seconds": round(build_seconds, 2),
        "total_seconds": round(time.perf_counter() - t_start, 2),
        "param_bytes": config["param_bytes"],
    }
    log(f"wrote {out_dir} in {summary['total_seconds']:.1f} s (library built in {build_seconds:.1f} s)")
    return summary
