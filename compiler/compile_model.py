"""`mobilec compile`: checkpoint -> Relax IR -> compiled library + weight shards, as one artifact directory."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tqdm import tqdm

from . import hexagon, link, pipeline, validate
from .artifact import (
    CONFIG_FILE,
    FORMAT_VERSION,
    LIBRARY_DIR,
    PARAMS_DIR,
    TOKENIZER_DIR,
    file_manifest,
    installed_versions,
)
from .cpu_check import cpu_entry
from .errors import MobilecError
from .export import ShardWriter, atomic_directory, check_output
from .kernels import integer_dot_gemv
from .loaders import Checkpoint, open_checkpoint
from .loaders.default_model import default_model_path
from .models.llama import LlamaConfig
from .models.registry import ModelFamily, family_for
from .passes.apply_tuning_database import tuned_kernels
from .quantization import awq
from .quantization.quantize_model import WeightPlan, quantize_model
from .quantization.schemes import Scheme, get_scheme
from .targets import TargetSpec, load_target

PAGE_SIZE = 16
DECODE_ACTIVATIONS = tuple(f"int{bits}" for bits in integer_dot_gemv.ACTIVATION_BITS)


def resolve_model_path(model: str | None) -> Path:
    if model in (None, "default"):
        return default_model_path()
    return Path(model)


def model_name(path: Path) -> str:
    return path.stem if path.is_file() else path.resolve().name


def default_output(model_path: Path, quant: str, target: str) -> Path:
    return Path("build") / f"{model_name(model_path)}-{quant}-{target}"


@dataclasses.dataclass
class ImportedModel:
    family: ModelFamily
    cfg: LlamaConfig
    mod: tvm.IRModule | None  # None when imported with export=False
    params: list  # (name, nn.Parameter) in the order the compiled functions take them
    sources: dict[str, list[str]]  # float parameter -> checkpoint tensors
    plan: WeightPlan  # quantized layer -> how to make its stored arrays
    dtype: str  # activations: the float scheme's dtype, or the target's compute dtype
    calibration: awq.Calibration | None = None  # --calibrate: scales folded into the float parameters


def import_model(ckpt: Checkpoint, scheme: Scheme, spec: TargetSpec, context_window: int | None,
                 quant_skip: list[str] = (), quantize: bool = True,
                 calibration: awq.Calibration | None = None, export: bool = True) -> ImportedModel:
    """Build the nn.Module for the checkpoint's family, quantize its layers (unless told not to: `inspect`
    shows the float import first), and export it to a Relax IRModule (unless told not to: the parameters'
    shapes and dtypes, all `estimate` needs of another scheme, come without the seconds exporting takes)."""
    validate.context_length(context_window)
    family = family_for(ckpt.hf_config)
    cfg = family.config_class.from_hf(ckpt.hf_config, context_window)
    check_checkpoint_shapes(ckpt, cfg)
    model = family.model_class(cfg)
    dtype = scheme.float_dtype or spec.device["compute_dtype"]
    model.to(dtype)
    sources = cfg.param_sources()
    plan = quantize_model(model, scheme, ckpt, sources, list(quant_skip), dtype, calibration) if quantize else {}
    if not export:  # named_parameters() lists them as export_tvm does
        return ImportedModel(family, cfg, None, list(model.named_parameters()), sources, plan, dtype, calibration)
    with spec.model_target():
        mod, params = model.export_tvm(spec=model.get_default_spec())
    return ImportedModel(family, cfg, mod, params, sources, plan, dtype, calibration)


def check_checkpoint_shapes(ckpt: Checkpoint, cfg: LlamaConfig) -> None:
    """Every tensor the model reads is in the checkpoint with the shape its config implies, checked by the
    checkpoint's own tensor names before any weight is read or anything built (a config-only checkpoint, as
    `estimate` takes, has no tensors to check)."""
    if not ckpt.tensor_names():
        return
    for name, want in cfg.source_shapes().items():
        got = tuple(int(d) for d in ckpt.shape(name))
        if got != want:
            raise MobilecError(f"tensor {name} has shape {got} in {ckpt.description} but its config implies {want}; "
                               f"the checkpoint and its config disagree")


def _stored_array(ckpt: Checkpoint, imported: ImportedModel, name: str, made: dict[str, dict[str, np.ndarray]]):
    """The array to store for parameter `name`: from a quantized layer's plan, or checkpoint tensors as they are."""
    layer, _, suffix = name.rpartition(".")
    if layer in imported.plan and suffix != "bias":
        if layer not in made:
            made[layer] = imported.plan[layer]()
        array = made[layer].pop(suffix)
        if not made[layer]:
            del made[layer]
        return array
    parts = [ckpt.get(src) for src in imported.sources[name]]
    array = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return imported.calibration.float_param(name, array) if imported.calibration else array


def write_params(ckpt: Checkpoint, imported: ImportedModel, out: Path, progress: bool):
    """Convert weights one layer at a time, so only one layer is in memory beyond the checkpoint's map."""
    writer = ShardWriter(out / PARAMS_DIR)
    made: dict[str, dict[str, np.ndarray]] = {}
    for name, param in tqdm(imported.params, desc="weights", unit="tensor", disable=not progress, file=sys.stderr):
        array = _stored_array(ckpt, imported, name, made)
        if tuple(array.shape) != tuple(int(d) for d in param.shape):
            raise MobilecError(
                f"tensor {name} has shape {tuple(array.shape)} in the checkpoint but the config implies "
                f"{tuple(int(d) for d in param.shape)}; the checkpoint and its config.json disagree"
            )
        writer.add(name, array.astype(param.dtype, copy=False))
    return writer.finish(out)


def _check_decode_activations(value: str, spec: TargetSpec) -> None:
    if value not in DECODE_ACTIVATIONS:
        raise MobilecError(f"--decode-activations {value!r} is not one of {', '.join(DECODE_ACTIVATIONS)}")
    if value != "int16" and not integer_dot_gemv.available(spec.tvm_target()):
        raise MobilecError(f"--decode-activations {value} needs a CPU target with integer decode GEMVs (x86 with "
                           f"AVX2 or AVX-512, aarch64 with the dot product: +dotprod or +i8mm); {spec.name} decodes "
                           f"with float activations: drop the option")


def compile_model(
    model: str | None,
    target: str,
    quant: str | None,
    output: str | None = None,
    context_window: int | None = None,
    progress: bool = True,
    quant_skip: list[str] = (),
    calibrate: str | None = None,
    calib_text: str | None = None,
    force: bool = False,
    no_tuning: bool = False,
    decode_activations: str = "int16",
    overwrite: bool = False,
) -> dict[str, Any]:
    """Compile and write the artifact; returns a summary (path, timings, sizes, kernels scheduled from the
    target's tuning log, which `no_tuning` leaves unread). A model that does not fit the target's memory is
    refused unless `force`. `decode_activations`: int16 (float-accurate) or int8 (faster, llama.cpp's rounding) for
    the integer decode GEMVs of x86 CPU targets. The output must be a new path, an empty directory, or an artifact
    (replaced only with `overwrite`): export.check_output."""
    # Imported here because estimate imports this module.
    from .estimate import estimate_imported, over_budget_message  # pylint: disable=import-outside-toplevel

    validate.context_length(context_window)
    if output:
        check_output(Path(output), overwrite)  # before anything is loaded or built
    spec = load_target(target)
    _check_decode_activations(decode_activations, spec)
    link.check_toolchain(spec)  # before the build, not after it
    scheme = get_scheme(quant or spec.device["default_quant"])
    awq.check_options(calibrate, calib_text, scheme.layout)
    model_path = resolve_model_path(model)
    out_dir = Path(output) if output else default_output(model_path, scheme.name, spec.name)
    check_output(out_dir, overwrite)
    progress = progress and sys.stderr.isatty()  # progress text is for people; logs and pipes stay clean
    log = (lambda msg: print(msg, file=sys.stderr)) if progress else (lambda msg: None)
    t_start = time.perf_counter()
    with open_checkpoint(model_path) as ckpt, atomic_directory(out_dir, overwrite) as tmp:
        log(f"importing {ckpt.description}")
        calibration = awq.calibrate(ckpt, scheme.layout, calib_text, log) if calibrate else None
        imported = import_model(ckpt, scheme, spec, context_window, quant_skip, calibration=calibration)
        family, cfg = imported.family, imported.cfg
        memory = estimate_imported(ckpt, imported, scheme, spec, quant_skip)
        if not memory.fits and not force:
            raise MobilecError(f"{over_budget_message(memory)}; or --force to compile it anyway")
        log(f"compiling {family.name} for {spec.name} ({scheme.name})")
        t_build = time.perf_counter()
        (tmp / LIBRARY_DIR).mkdir()
        tuned: list[str] = []

        def note_tuned(_index: int, step: str, mod: tvm.IRModule) -> None:
            if step == pipeline.APPLY_TUNING_STEP:
                tuned.extend(tuned_kernels(mod))

        npu = None
        if spec.link["method"] == "hexagon":
            lowered = pipeline.run_steps(imported.mod, spec, note_tuned, tuning=not no_tuning,
                                         decode_activations=decode_activations)
            name, npu = hexagon.build_kernels(lowered, spec, tmp / LIBRARY_DIR)
            note = npu.get("note")
        else:
            executable = pipeline.build(imported.mod, spec, tuning=not no_tuning, after_step=note_tuned,
                                        decode_activations=decode_activations)
            name, note = link.export_library(executable, spec, tmp / LIBRARY_DIR)
        library = f"{LIBRARY_DIR}/{name}"
        build_seconds = time.perf_counter() - t_build
        index = write_params(ckpt, imported, tmp, progress)
        ckpt.save_tokenizer(tmp / TOKENIZER_DIR)
        config = {
            "format_version": FORMAT_VERSION,
            "model": {
                "name": model_name(model_path),
                "path": str(model_path.resolve()),
                "family": family.name,
                "source": ckpt.description,
                "config": dataclasses.asdict(cfg),
            },
            "quantization": {**scheme.to_json(), "skip": list(quant_skip), "quantized_layers": sorted(imported.plan),
                             "calibration": calibration.summary if calibration else None},
            "compute_dtype": imported.dtype,
            "decode_activations": decode_activations if integer_dot_gemv.available(spec.tvm_target()) else None,
            "target": {
                "name": spec.name,
                "description": spec.description,
                "tvm_target": spec.tvm_target_json,
                "file_sha256": spec.sha256,
            },
            # the CPU the library's code needs (arch, features): a CPU without them refuses it (cpu_check.py)
            "cpu": cpu_entry(spec.tvm_target()),
            "library": library,
            **({"npu_coverage": npu} if npu else {}),
            "context_window": cfg.context_window_size,
            "prefill_chunk": cfg.prefill_chunk_size,
            "page_size": PAGE_SIZE,
            "param_bytes": sum(t["nbytes"] for t in index["tensors"]),
            "memory_estimate": memory.to_json(),
            "versions": installed_versions(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        # every file but this config, with its size and sha256 (the shards' computed as they were written)
        config["files"] = file_manifest(tmp, {f"{PARAMS_DIR}/{s['file']}": s["sha256"] for s in index["shards"]})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    summary = {
        "artifact": str(out_dir),
        "target": spec.name,
        "quant": scheme.name,
        "build_seconds": round(build_seconds, 2),
        "total_seconds": round(time.perf_counter() - t_start, 2),
        "param_bytes": config["param_bytes"],
        "tuned_kernels": tuned,
        **({"note": note} if note else {}),
        **({"npu_coverage": npu} if npu else {}),
    }
    log(f"wrote {out_dir} in {summary['total_seconds']:.1f} s (library built in {build_seconds:.1f} s)")
    return summary
